package adapters_test

// The tests open every scheme: they link every broker.
import _ "github.com/oncemill/oncemill/internal/allbrokers"
