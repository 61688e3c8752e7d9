package main

// The command opens any broker URL an operator gives it: it links every
// broker package and both embedded brokers.
import _ "github.com/oncemill/oncemill/internal/allbrokers"
