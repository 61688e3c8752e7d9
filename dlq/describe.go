package dlq

import (
	"strconv"

	"github.com/oncemill/oncemill/delivery"
)

// Counted says what a dead letter's attempt count counts and who counted
// it, for people: the source that the poison middleware recorded
// (delivery.DeadAttemptsSource).
type Counted struct {
	// Label names the figure: "Failed attempts" when the inbox or the
	// consumer counted failures, "Broker deliveries" when it is the
	// broker's count of deliveries (which also grows with deliveries that
	// did not fail), "Attempts" when the entry does not say.
	Label string
	// Source says who counted it, in a few words.
	Source string
	// Short names the source in one word for a table column: "inbox",
	// "broker", "process", or "-" when the entry does not say.
	Short string
}

// AttemptsCounted says what e.Attempts counts and who counted it.
func (e Entry) AttemptsCounted() Counted {
	switch e.Metadata[delivery.DeadAttemptsSource] {
	case delivery.AttemptsFromInbox:
		return Counted{Label: "Failed attempts", Source: "counted by the inbox", Short: "inbox"}
	case delivery.AttemptsFromBroker:
		which := "RabbitMQ x-delivery-count or SQS ApproximateReceiveCount"
		if e.Metadata[delivery.DeadStream] != "" {
			which = "JetStream NumDelivered"
		}
		return Counted{Label: "Broker deliveries", Source: "the broker's count, not failures: " + which, Short: "broker"}
	case delivery.AttemptsFromProcess:
		return Counted{Label: "Failed attempts", Source: "counted in the consumer's memory since it started", Short: "process"}
	}
	return Counted{Label: "Attempts", Source: "source not recorded", Short: "-"}
}

// Fact is one labelled value of a dead letter, for people.
type Fact struct {
	Label, Value string
}

// Place returns where the broker kept the original, only as far as e
// records it: the Kafka partition and offset of a Kafka delivery, the
// JetStream stream and sequence of a NATS one; nothing for RabbitMQ or
// SQS, whose queue is the topic. It starts with the entry e was replayed
// from ("Replayed from", "#N"), for a replay that died again
// ([Entry.ReplayedFrom]).
func (e Entry) Place() []Fact {
	var facts []Fact
	if id, ok := e.ReplayedFrom(); ok {
		facts = append(facts, Fact{"Replayed from", "#" + strconv.FormatInt(id, 10)})
	}
	if e.Partition != nil {
		facts = append(facts, Fact{"Kafka partition", strconv.FormatInt(int64(*e.Partition), 10)})
	}
	if e.Offset != nil {
		facts = append(facts, Fact{"Kafka offset", strconv.FormatInt(*e.Offset, 10)})
	}
	if v := e.Metadata[delivery.DeadStream]; v != "" {
		facts = append(facts, Fact{"JetStream stream", v})
	}
	if v := e.Metadata[delivery.DeadStreamSequence]; v != "" {
		facts = append(facts, Fact{"JetStream sequence", v})
	}
	return facts
}
