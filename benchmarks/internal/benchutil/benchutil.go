// Package benchutil holds what the benchmark commands share: flag and
// environment helpers, the location of the results files, seeded UUIDs,
// random run IDs and a logger that counts errors.
package benchutil

import (
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
)

// ParseInts parses a comma-separated list of integers.
func ParseInts(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil {
			return nil, fmt.Errorf("parse %q: %w", s, err)
		}
		out = append(out, v)
	}
	return out, nil
}

// FlagSet reports whether the flag name was given on the command line.
func FlagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// EnvOr returns the environment variable key, or def when it is unset or
// empty.
func EnvOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// ModulePath is the import path of the benchmarks module, whose root
// directory holds the results files.
const ModulePath = "github.com/oncemill/oncemill/benchmarks"

// Path returns the file elem of the benchmarks module's root directory
// (benchmarks/ in the repository), relative to the working directory, so
// that a command writes the same results files whether it runs from the
// repository root, from benchmarks/ (as the Makefile's bench targets do)
// or from below it. The root is the first of the working directory and its
// parents that is the module's root or holds it as benchmarks/; without
// one, the path is under benchmarks/ of the working directory.
func Path(elem ...string) string {
	return filepath.Join(append([]string{moduleDir()}, elem...)...)
}

// moduleDir returns the benchmarks module's root directory, relative to
// the working directory.
func moduleDir() string {
	const fallback = "benchmarks"
	wd, err := os.Getwd()
	if err != nil {
		return fallback
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		for _, cand := range []string{dir, filepath.Join(dir, "benchmarks")} {
			if !declaresModule(filepath.Join(cand, "go.mod")) {
				continue
			}
			if rel, err := filepath.Rel(wd, cand); err == nil {
				return rel
			}
			return cand
		}
		if filepath.Dir(dir) == dir {
			return fallback
		}
	}
}

// declaresModule reports whether the go.mod file at path declares
// ModulePath.
func declaresModule(path string) bool {
	data, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(data)) {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`+"`") == ModulePath
		}
	}
	return false
}

// SeededUUID formats 16 random bytes from rng as a version 4 UUID, so that
// a stream's UUIDs are reproducible from its seed.
func SeededUUID(rng *mrand.Rand) string {
	var b [16]byte
	for i := 0; i < 16; i += 8 {
		v := rng.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// RandomID returns 8 random hex digits, to name a run's schemas, topics
// and groups.
func RandomID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// SyncWriter returns a writer that passes each Write on to w under a
// lock, so that a run's progress lines and the errors its loggers print
// from handler and subscriber goroutines can share a writer that is not
// safe for concurrent use, such as a test's strings.Builder.
func SyncWriter(w io.Writer) io.Writer {
	if s, ok := w.(*syncWriter); ok {
		return s
	}
	return &syncWriter{w: w}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// CountingLogger is a Watermill logger that prints the first few errors of
// a run and counts them all; it drops everything else.
type CountingLogger struct {
	out    io.Writer
	prefix string
	max    int64
	n      *atomic.Int64
}

var _ watermill.LoggerAdapter = CountingLogger{}

// NewCountingLogger returns a CountingLogger that prints up to maxPrinted
// errors to out, each line prefixed with prefix.
func NewCountingLogger(out io.Writer, prefix string, maxPrinted int64) CountingLogger {
	return CountingLogger{out: out, prefix: prefix, max: maxPrinted, n: new(atomic.Int64)}
}

// Errors returns how many errors were logged.
func (l CountingLogger) Errors() int64 { return l.n.Load() }

// Error counts the error and prints it if fewer than the maximum were.
func (l CountingLogger) Error(msg string, err error, fields watermill.LogFields) {
	if n := l.n.Add(1); n <= l.max {
		fmt.Fprintf(l.out, "  %s: logged error: %s: %v %v\n", l.prefix, msg, err, fields)
	}
}

// Info drops the line.
func (CountingLogger) Info(string, watermill.LogFields) {}

// Debug drops the line.
func (CountingLogger) Debug(string, watermill.LogFields) {}

// Trace drops the line.
func (CountingLogger) Trace(string, watermill.LogFields) {}

// With returns l: fields are not printed.
func (l CountingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }
