package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// flagsOf returns the names of the flags c defines: what its run parses.
func flagsOf(t *testing.T, c command) []string {
	t.Helper()
	var out, errOut bytes.Buffer
	x := &cmd{name: "oncemill " + c.path, env: func(string) string { return "" }, stdout: &out, stderr: &errOut, now: time.Now()}
	err := c.run(x, context.Background(), []string{"--help"})
	var help helpRequest
	require.True(t, errors.As(err, &help), "%s --help: %v", c.path, err)
	var names []string
	help.fs.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	require.NotEmpty(t, names, c.path)
	return names
}

// TestEveryCommandHelpListsItsFlags: each command's --help and -h print
// that command's usage, with every flag the command accepts and an example
// that uses only those flags, and exit 0;
// the global help lists the commands and where their flags are.
func TestEveryCommandHelpListsItsFlags(t *testing.T) {
	t.Parallel()
	global := oncemill(t, nil, "--help")
	require.Equal(t, exitOK, global.code)
	require.Contains(t, global.stdout, "'oncemill <command> --help'")

	for _, c := range commands {
		require.Contains(t, global.stdout, "\n  "+c.path+" ", "the global help lists %s", c.path)
		flags := flagsOf(t, c)
		for _, h := range []string{"--help", "-h"} {
			args := append(strings.Fields(c.path), h)
			r := oncemill(t, nil, args...)
			require.Equal(t, exitOK, r.code, "%v: %s", args, r.stderr)
			require.Empty(t, r.stderr, args)
			require.True(t, strings.HasPrefix(r.stdout, "Usage: oncemill "+c.path+" "), "%v prints its own usage, not the global one:\n%s", args, r.stdout)
			for _, f := range flags {
				require.Contains(t, r.stdout, "\n  --"+f, "%v lists --%s", args, f)
			}
			require.Contains(t, r.stdout, "\nExample:\n  "+c.example+"\n", "%v ends with its example", args)
		}
		require.True(t, strings.HasPrefix(c.example, "oncemill "+c.path+" "), "%s has an example of itself: %q", c.path, c.example)
		for _, w := range strings.Fields(c.example) {
			if name, ok := strings.CutPrefix(w, "--"); ok {
				name, _, _ = strings.Cut(name, "=")
				require.Contains(t, flags, name, "the example of %s uses only its flags", c.path)
			}
		}
	}
	replay := oncemill(t, nil, "dlq", "replay", "--help")
	require.Contains(t, replay.stdout, "\n  --to-consumer\n")
	require.NotContains(t, global.stdout, "--to-consumer", "flags are in each command's help, not the global one")
}
