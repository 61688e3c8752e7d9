package middleware

import (
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// storedMessage is how a produced message is kept with its claim, so that a
// duplicate delivery returns the very same messages (same UUIDs) for the
// router to publish again.
type storedMessage struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

// encodeResult returns nil for no messages, so that nothing is stored.
func encodeResult(msgs []*message.Message) ([]byte, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	stored := make([]storedMessage, len(msgs))
	for i, m := range msgs {
		stored[i] = storedMessage{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload}
	}
	b, err := json.Marshal(stored)
	if err != nil {
		return nil, fmt.Errorf("middleware: encode produced messages: %w", err)
	}
	return b, nil
}

func decodeResult(b []byte) ([]*message.Message, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var stored []storedMessage
	if err := json.Unmarshal(b, &stored); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadResult, err)
	}
	msgs := make([]*message.Message, len(stored))
	for i, s := range stored {
		m := message.NewMessage(s.UUID, s.Payload)
		for k, v := range s.Metadata {
			m.Metadata.Set(k, v)
		}
		msgs[i] = m
	}
	return msgs, nil
}
