package sqldb

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/oncemill/oncemill/delivery"
)

// The rules that make a producer's or an operator's bytes storable, in
// every table the SQL layer writes, on every database: a value is stored
// as it is, stored in a bounded form with a digest, or refused with a
// reason ([ErrNotStorable]) — never sent as it is to a column that
// refuses it, which the database answers with an error (PostgreSQL's
// SQLSTATE 22021 for invalid UTF-8, 22P05 for a NUL in jsonb, 54000 for
// an index row too large) that the caller would take for an outage.
//
// What each kind of value gets:
//
//   - free text (an error's text, a dead letter's metadata): [CleanText],
//     U+FFFD in place of NUL and invalid UTF-8;
//   - an identifier that a column indexes or that rows are compared by (a
//     consumer, a topic, a UUID, a key, an ordering key): [Ident], the
//     value itself when it is storable text of at most [MaxIdentBytes],
//     else a bounded form that ends in the SHA-256 of the whole value, so
//     that two values stay two and one value always gives one form;
//   - a message's metadata that must come back byte for byte (a parked
//     message, an outbox row): [EncodeMetadata] and [DecodeMetadata];
//   - a value that must be stored whole and cannot be (an outbox row's
//     topic): [CheckWhole], which refuses it with the reason.

// ErrNotStorable is wrapped by the error of a value that no column of its
// table can hold as it must be held: the message names the field, what
// is wrong and the fix. It is the value's fault, never an outage.
var ErrNotStorable = errors.New("sqldb: the value cannot be stored")

// MaxIdentBytes is the most bytes [Ident] returns, and the longest
// identifier stored as it is: delivery.MaxBoundBytes. Four of them fit
// PostgreSQL's B-tree row (about 2,700 bytes).
const MaxIdentBytes = delivery.MaxBoundBytes

// MaxWholeBytes is the longest value [CheckWhole] accepts: the size of
// MySQL's BLOB and TEXT columns, the smallest column that holds such a
// value whole.
const MaxWholeBytes = 65535

// Storable reports whether s is text that every database's text and
// JSON columns store as it is: valid UTF-8 without NUL.
func Storable(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// CleanText returns s with U+FFFD in place of each NUL and each run of
// bytes that is not UTF-8: free text as every database stores it. It is
// lossy; an identifier takes [Ident] instead.
func CleanText(s string) string {
	if Storable(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// Ident returns the form in which a table stores, indexes and compares an
// identifier: s itself when it is storable text ([Storable]) of at most
// [MaxIdentBytes]; otherwise a readable prefix of s (cleaned as by
// [CleanText]) followed by "…sha256:" and the hex SHA-256 of the whole of
// s, MaxIdentBytes at most. For storable text it is [delivery.Bound]. The
// same value always gives the same form (a binary Kafka key, copied into
// a partition key, is one ordering key wherever it is compared); two
// values give two forms; Ident of a form is that form.
func Ident(s string) string {
	if Storable(s) {
		return delivery.Bound(s)
	}
	sum := sha256.Sum256([]byte(s))
	suffix := "…sha256:" + hex.EncodeToString(sum[:])
	c := CleanText(s)
	n := min(len(c), MaxIdentBytes-len(suffix))
	for n > 0 && n < len(c) && !utf8.RuneStart(c[n]) {
		n--
	}
	return c[:n] + suffix
}

// CheckWhole returns nil when s, the value of field, can be stored whole
// in a text column on every database: storable text ([Storable]) of at
// most max bytes (0 for [MaxWholeBytes]). Otherwise it returns an error
// wrapping [ErrNotStorable] that names field, what is wrong and the fix.
func CheckWhole(field, s string, max int) error {
	if max <= 0 {
		max = MaxWholeBytes
	}
	switch {
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s %s is not valid UTF-8: write it as text", ErrNotStorable, field, quoteClip(s))
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%w: %s %s holds a NUL byte, which PostgreSQL's text refuses: write it without", ErrNotStorable, field, quoteClip(s))
	case len(s) > max:
		return fmt.Errorf("%w: %s is %d bytes, more than %d: shorten it", ErrNotStorable, field, len(s), max)
	}
	return nil
}

// quoteClip quotes the first 64 bytes of s, for an error.
func quoteClip(s string) string {
	if len(s) > 64 {
		return strconv.Quote(s[:64]) + "…"
	}
	return strconv.Quote(s)
}

// CleanMetadata returns md with each key and value cleaned ([CleanText]):
// a message's metadata as free text, which a dead letter keeps. Where two
// keys clean to one, the one that was storable text wins, else the
// lower; the result is the same for the same md.
func CleanMetadata(md map[string]string) map[string]string {
	out := make(map[string]string, len(md))
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		ck := CleanText(k)
		if _, taken := out[ck]; taken && ck != k {
			continue
		}
		out[ck] = CleanText(md[k])
	}
	return out
}

// ExactKey is the metadata key under which [EncodeMetadata] keeps, in
// base64, what JSON text cannot hold: the entries of a message's metadata
// whose key or value is not storable text, and a UUID that its column
// holds in another form. A message's own entry of this key is kept there
// too, so that no metadata is mistaken for it.
const ExactKey = "oncemill_exact"

// exact is the value of [ExactKey]: base64 of the bytes.
type exact struct {
	UUID     string      `json:"uuid,omitempty"`
	Metadata [][2]string `json:"metadata,omitempty"`
}

// EncodeMetadata returns md as the text of a JSON object of strings that
// every database's JSON and text columns store (PostgreSQL's jsonb
// refuses NUL, and JSON cannot carry bytes that are not UTF-8), from which
// [DecodeMetadata] gives md back byte for byte. Entries of storable text
// ([Storable]) are written as they are; the others, and uuid when it is
// not "", under [ExactKey], in base64.
func EncodeMetadata(md map[string]string, uuid string) string {
	out := make(map[string]string, len(md)+1)
	var x exact
	for k, v := range md {
		if k == ExactKey || !Storable(k) || !Storable(v) {
			x.Metadata = append(x.Metadata, [2]string{b64(k), b64(v)})
			continue
		}
		out[k] = v
	}
	if uuid != "" {
		x.UUID = b64(uuid)
	}
	if len(x.Metadata) > 0 || x.UUID != "" {
		slices.SortFunc(x.Metadata, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
		b, _ := json.Marshal(x) // strings of base64 always encode
		out[ExactKey] = string(b)
	}
	b, _ := json.Marshal(out) // storable strings always encode
	return string(b)
}

// DecodeMetadata reads what [EncodeMetadata] wrote: the metadata, and the
// UUID it kept ("" when none). JSON null is no metadata. Text that is not
// a JSON object of strings, or an [ExactKey] entry that is not one
// EncodeMetadata wrote, is an error.
func DecodeMetadata(b []byte) (map[string]string, string, error) {
	var md map[string]string
	if err := json.Unmarshal(b, &md); err != nil {
		return nil, "", err
	}
	if md == nil {
		md = map[string]string{}
	}
	raw, ok := md[ExactKey]
	if !ok {
		return md, "", nil
	}
	delete(md, ExactKey)
	var x exact
	if err := json.Unmarshal([]byte(raw), &x); err != nil {
		return nil, "", fmt.Errorf("metadata %s: %w", ExactKey, err)
	}
	uuid, err := unb64(x.UUID)
	if err != nil {
		return nil, "", fmt.Errorf("metadata %s: uuid: %w", ExactKey, err)
	}
	for _, kv := range x.Metadata {
		k, err := unb64(kv[0])
		if err != nil {
			return nil, "", fmt.Errorf("metadata %s: key: %w", ExactKey, err)
		}
		v, err := unb64(kv[1])
		if err != nil {
			return nil, "", fmt.Errorf("metadata %s: value of %q: %w", ExactKey, k, err)
		}
		md[k] = v
	}
	return md, uuid, nil
}

// HasExact reports whether b, a metadata column that [EncodeMetadata]
// wrote, keeps anything under [ExactKey]: a reader that reads the column
// as JSON (PostgreSQL's metadata->>'key') does not see those entries.
func HasExact(b []byte) bool {
	if !bytes.Contains(b, []byte(ExactKey)) {
		return false // the common case, without parsing
	}
	var top map[string]json.RawMessage
	if json.Unmarshal(b, &top) != nil {
		return false
	}
	_, ok := top[ExactKey]
	return ok
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func unb64(s string) (string, error) {
	b, err := base64.StdEncoding.DecodeString(s)
	return string(b), err
}

// InboxLookup is [Dialect.InboxArgs] for a statement that reads or writes
// the inbox row of consumer and key: ok is false when the pair is not
// storable text ([Storable]), which no inbox holds (the inbox refuses such
// a key, and such a consumer name, before it writes), so that the caller
// answers "no such record" instead of sending PostgreSQL text it refuses.
func (d *Dialect) InboxLookup(consumer, key string) (c, k any, ok bool) {
	if !Storable(consumer) || !Storable(key) {
		return nil, nil, false
	}
	c, k = d.InboxArgs(consumer, key)
	return c, k, true
}
