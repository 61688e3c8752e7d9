// Command kafkaonly links Kafka without its embedded broker: the adapters
// tests check what Open answers it for kafka:// with no host.
package main

import (
	"context"
	"fmt"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/kafka"
)

func main() {
	_, err := adapters.Open(context.Background(), "kafka://?group=g", adapters.Options{})
	fmt.Println(err)
}
