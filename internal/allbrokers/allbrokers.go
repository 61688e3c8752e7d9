// Package allbrokers links every broker package and both embedded
// brokers, for the tests and commands that open any scheme: importing it
// is importing each of them for its side effect.
package allbrokers

import (
	_ "github.com/oncemill/oncemill/adapters/amqp"
	_ "github.com/oncemill/oncemill/adapters/kafka"
	_ "github.com/oncemill/oncemill/adapters/kafka/embedded"
	_ "github.com/oncemill/oncemill/adapters/nats"
	_ "github.com/oncemill/oncemill/adapters/nats/embedded"
	_ "github.com/oncemill/oncemill/adapters/postgres"
	_ "github.com/oncemill/oncemill/adapters/sqs"
)
