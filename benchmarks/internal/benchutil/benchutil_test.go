package benchutil_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

func TestParseInts(t *testing.T) {
	got, err := benchutil.ParseInts("1, 8,32")
	if err != nil || len(got) != 3 || got[0] != 1 || got[1] != 8 || got[2] != 32 {
		t.Fatalf("ParseInts: %v, %v", got, err)
	}
	if _, err := benchutil.ParseInts("1,x"); err == nil || !strings.Contains(err.Error(), `"1,x"`) {
		t.Fatalf("ParseInts(1,x): %v, want an error naming the input", err)
	}
}

func TestSeededUUID(t *testing.T) {
	v4 := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	a, b := rand.New(rand.NewPCG(1, 2)), rand.New(rand.NewPCG(1, 2))
	first := benchutil.SeededUUID(a)
	if !v4.MatchString(first) {
		t.Fatalf("%s is not a version 4 UUID", first)
	}
	if again := benchutil.SeededUUID(b); again != first {
		t.Fatalf("same seed, %s then %s", first, again)
	}
	if next := benchutil.SeededUUID(a); next == first {
		t.Fatalf("the next UUID repeats %s", first)
	}
}

func TestCountingLogger(t *testing.T) {
	var out bytes.Buffer
	l := benchutil.NewCountingLogger(&out, "run", 2)
	for range 5 {
		l.With(nil).Error("publish", errors.New("broker down"), nil)
	}
	l.Info("ignored", nil)
	if l.Errors() != 5 {
		t.Fatalf("counted %d errors, want 5", l.Errors())
	}
	if n := strings.Count(out.String(), "broker down"); n != 2 {
		t.Fatalf("printed %d errors, want 2:\n%s", n, out.String())
	}
}

// TestPath finds the benchmarks module's root, where the results files
// are, from the directories the commands are run in.
func TestPath(t *testing.T) {
	// The test runs in benchmarks/internal/benchutil.
	pkg, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	repo := filepath.Join(pkg, "..", "..", "..")
	for _, c := range []struct{ wd, want string }{
		{repo, filepath.Join("benchmarks", "README.md")},
		{filepath.Join(repo, "benchmarks"), "README.md"},
		{filepath.Join(repo, "benchmarks", "kafka"), filepath.Join("..", "README.md")},
		{pkg, filepath.Join("..", "..", "README.md")},
		{t.TempDir(), filepath.Join("benchmarks", "README.md")},
	} {
		t.Chdir(c.wd)
		if got := benchutil.Path("README.md"); got != c.want {
			t.Errorf("from %s: Path(README.md) = %s, want %s", c.wd, got, c.want)
		}
	}
	t.Chdir(repo)
	if _, err := os.Stat(benchutil.Path("RESULTS.md")); err != nil {
		t.Errorf("the results file is not where Path says: %v", err)
	}
}

// TestSyncWriter shares a strings.Builder between goroutines, as a run's
// progress lines and its loggers do; under -race an unlocked Write fails.
func TestSyncWriter(t *testing.T) {
	var out strings.Builder
	w := benchutil.SyncWriter(&out)
	if benchutil.SyncWriter(w) != w {
		t.Error("SyncWriter wraps a writer it returned again")
	}
	const writers, lines = 4, 100
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			for range lines {
				fmt.Fprintln(w, "line")
			}
		})
	}
	wg.Wait()
	if n := strings.Count(out.String(), "line\n"); n != writers*lines {
		t.Fatalf("%d whole lines written, want %d", n, writers*lines)
	}
}
