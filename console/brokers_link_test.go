package console_test

// The console's broker tests replay to RabbitMQ.
import _ "github.com/oncemill/oncemill/adapters/amqp"
