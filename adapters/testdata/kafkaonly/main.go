// Command kafkaonly is a program that links Kafka, without its embedded broker, and no other broker:
// the adapters tests check what it depends on and what Open answers it
// for a scheme it does not link.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/kafka"
)

// main opens each URL of its arguments and prints, a line each, "ok" or
// the error.
func main() {
	for _, u := range os.Args[1:] {
		ps, err := adapters.Open(context.Background(), u, adapters.Options{})
		if err != nil {
			fmt.Println(err)
			continue
		}
		_ = ps.Close()
		fmt.Println("ok")
	}
}
