package console

// NormalizeSQL exposes the SQL form of NormalizeError, for the test that
// runs both on one corpus.
var NormalizeSQL = normalizeSQL

// FormatRanges and ParseRanges expose how the confirm step carries ids.
var (
	FormatRanges = formatRanges
	ParseRanges  = parseRanges
)
