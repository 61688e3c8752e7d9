package console

// NormalizeMySQL exposes the MySQL form of NormalizeError, for the test
// that runs both on one corpus.
var NormalizeMySQL = normalizeMySQL
