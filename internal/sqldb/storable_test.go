package sqldb_test

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
)

// kafkaKey is a Kafka record key from Java's LongSerializer (42): valid
// UTF-8 with seven NULs.
const kafkaKey = "\x00\x00\x00\x00\x00\x00\x00\x2a"

// TestIdent: storable text up to 512 bytes is kept; anything else becomes
// storable text of at most 512 bytes that ends in the digest of the whole
// value; one value always gives one form, two values two, and the form of
// a form is itself.
func TestIdent(t *testing.T) {
	t.Parallel()
	values := []string{"", "orders", "é", kafkaKey, "\x00", "\uFFFD", "a\xffb", "a\x00b", "a\uFFFDb",
		strings.Repeat("k", 512), strings.Repeat("k", 513), strings.Repeat("k", 1<<20), strings.Repeat("\x00", 1<<20),
		strings.Repeat("é", 300) + "\xff", "\xff" + strings.Repeat("x", 600)}
	forms := map[string]string{}
	for _, v := range values {
		f := sqldb.Ident(v)
		require.True(t, sqldb.Storable(f), "%q → %q", v, f)
		require.LessOrEqual(t, len(f), sqldb.MaxIdentBytes, "%q", v)
		require.Equal(t, f, sqldb.Ident(v), "one value, one form")
		require.Equal(t, f, sqldb.Ident(f), "a form is its own form")
		if sqldb.Storable(v) {
			require.Equal(t, delivery.Bound(v), f, "storable text is bounded as delivery.Bound bounds it")
		} else {
			require.Contains(t, f, "…sha256:")
		}
		if other, seen := forms[f]; seen {
			t.Fatalf("%q and %q share the form %q", other, v, f)
		}
		forms[f] = v
	}
	require.Equal(t, "orders", sqldb.Ident("orders"))
	require.True(t, strings.HasPrefix(sqldb.Ident(kafkaKey), strings.Repeat("\uFFFD", 7)+"*…sha256:"), sqldb.Ident(kafkaKey))
}

// TestCleanText: NUL and bytes that are not UTF-8 become U+FFFD; text is
// kept.
func TestCleanText(t *testing.T) {
	t.Parallel()
	require.Equal(t, "gateway 503", sqldb.CleanText("gateway 503"))
	require.Equal(t, "a\uFFFDb\uFFFDc", sqldb.CleanText("a\x00b\xffc"))
	require.True(t, utf8.ValidString(sqldb.CleanText("\xc3(")))
}

// TestCheckWhole: text is accepted; NUL, invalid UTF-8 and a value over
// the bound are refused with ErrNotStorable, the field named.
func TestCheckWhole(t *testing.T) {
	t.Parallel()
	require.NoError(t, sqldb.CheckWhole("topic", "orders", 0))
	for v, want := range map[string]string{
		"or\x00ders":                 `topic "or\x00ders" holds a NUL byte`,
		"or\xffders":                 `topic "or\xffders" is not valid UTF-8`,
		strings.Repeat("t", 1<<16+1): "topic is 65537 bytes, more than 65535",
	} {
		err := sqldb.CheckWhole("topic", v, 0)
		require.True(t, errors.Is(err, sqldb.ErrNotStorable), "%v", err)
		require.ErrorContains(t, err, want)
	}
	require.ErrorContains(t, sqldb.CheckWhole("uuid", "abcdef", 3), "uuid is 6 bytes, more than 3")
}

// TestMetadataRoundTrip: metadata with NUL, bytes that are not UTF-8, a
// binary Kafka key, 1 MB values and the reserved key itself is written as
// storable text and read back byte for byte, with the UUID kept; plain
// metadata is written as it is.
func TestMetadataRoundTrip(t *testing.T) {
	t.Parallel()
	plain := map[string]string{"trace_id": "tr-1", "partition_key": "acct-1"}
	enc := sqldb.EncodeMetadata(plain, "")
	require.Equal(t, `{"partition_key":"acct-1","trace_id":"tr-1"}`, enc)
	for _, tc := range []struct {
		md   map[string]string
		uuid string
	}{
		{plain, ""},
		{map[string]string{}, "u-1"},
		{nil, ""},
		{map[string]string{"partition_key": kafkaKey, "h": "a\x00b", "x\xff": "\xff", "big": strings.Repeat("\x00é", 1<<19)}, "uuid\x00" + strings.Repeat("u", 5000)},
		{map[string]string{sqldb.ExactKey: "not mine", "a": ""}, ""},
	} {
		enc := sqldb.EncodeMetadata(tc.md, tc.uuid)
		require.True(t, sqldb.Storable(enc))
		require.NotContains(t, enc, `\u0000`, "PostgreSQL's jsonb refuses the escape of NUL")
		md, uuid, err := sqldb.DecodeMetadata([]byte(enc))
		require.NoError(t, err)
		want := tc.md
		if want == nil {
			want = map[string]string{}
		}
		require.Equal(t, want, md)
		require.Equal(t, tc.uuid, uuid)
	}
	md, uuid, err := sqldb.DecodeMetadata([]byte(`null`))
	require.NoError(t, err)
	require.Empty(t, md)
	require.Empty(t, uuid)
	_, _, err = sqldb.DecodeMetadata([]byte(`{"` + sqldb.ExactKey + `":"{\"uuid\":\"%%\"}"}`))
	require.Error(t, err)
}

// TestCleanMetadata: keys and values cleaned; of two keys that clean to
// one, the storable one wins, whatever the map's order.
func TestCleanMetadata(t *testing.T) {
	t.Parallel()
	for range 20 {
		got := sqldb.CleanMetadata(map[string]string{"a\uFFFD": "text", "a\x00": "nul", "a\xff": "ff", "v": "x\x00"})
		require.Equal(t, map[string]string{"a\uFFFD": "text", "v": "x\uFFFD"}, got)
	}
	got := sqldb.CleanMetadata(map[string]string{"a\x00": "nul", "a\xff": "ff"})
	require.Equal(t, map[string]string{"a\uFFFD": "nul"}, got)
}
