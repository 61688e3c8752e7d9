package middleware

import (
	"encoding/json"
	"fmt"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// storedMessage is how a produced message is kept with its claim, so that a
// duplicate delivery returns the very same messages (same UUIDs) for the
// router to publish again.
//
// JSON strings hold UTF-8 only: a UUID or metadata that is not valid UTF-8
// would come back with U+FFFD in place of its bytes, another UUID for the
// next consumer's inbox. Such a message is kept with its strings as bytes
// (base64 in the JSON) in RawUUID and RawMetadata instead, which a decoder
// prefers; results stored before them decode as they did.
type storedMessage struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
	// RawUUID is the UUID's bytes, when it is not valid UTF-8.
	RawUUID []byte `json:"raw_uuid,omitempty"`
	// RawMetadata is the metadata as key and value bytes, one pair after
	// the other, when a key or value is not valid UTF-8.
	RawMetadata [][]byte `json:"raw_metadata,omitempty"`
}

// encodeResult returns nil for no messages, so that nothing is stored.
func encodeResult(msgs []*message.Message) ([]byte, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	stored := make([]storedMessage, len(msgs))
	for i, m := range msgs {
		s := storedMessage{UUID: m.UUID, Metadata: m.Metadata, Payload: m.Payload}
		if !utf8.ValidString(m.UUID) {
			s.UUID, s.RawUUID = "", []byte(m.UUID)
		}
		if !validMetadata(m.Metadata) {
			s.Metadata = nil
			for k, v := range m.Metadata {
				s.RawMetadata = append(s.RawMetadata, []byte(k), []byte(v))
			}
		}
		stored[i] = s
	}
	b, err := json.Marshal(stored)
	if err != nil {
		return nil, fmt.Errorf("middleware: encode produced messages: %w", err)
	}
	return b, nil
}

func validMetadata(md message.Metadata) bool {
	for k, v := range md {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return false
		}
	}
	return true
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
		if len(s.RawMetadata)%2 != 0 {
			return nil, fmt.Errorf("%w: message %d: raw_metadata holds %d items, not key and value pairs", ErrBadResult, i, len(s.RawMetadata))
		}
		uuid := s.UUID
		if s.RawUUID != nil {
			uuid = string(s.RawUUID)
		}
		m := message.NewMessage(uuid, s.Payload)
		for k, v := range s.Metadata {
			m.Metadata.Set(k, v)
		}
		for j := 0; j < len(s.RawMetadata); j += 2 {
			m.Metadata.Set(string(s.RawMetadata[j]), string(s.RawMetadata[j+1]))
		}
		msgs[i] = m
	}
	return msgs, nil
}
