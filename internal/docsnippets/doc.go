// Package docsnippets keeps the Go code of README.md and docs/*.md equal
// to source files that the build compiles. It has no code, only tests.
//
// Every ```go block in those documents is preceded by a marker naming its
// source, relative to the repository root:
//
//	<!-- snippet: examples/readme/main.go -->          the whole file
//	<!-- snippet: forwarder/docs_example_test.go#relay -->   a region of it
//
// A region is the lines between "// snippet:NAME" and "// endsnippet" in
// the source. The test compares each block with its source after removing
// the indentation common to their lines, and fails on a block without a
// marker, a marker without a block, a source the go command does not build
// (a build constraint, a testdata or _ directory), and a block that
// differs. To copy the sources into the documents:
//
//	go test ./internal/docsnippets -update
package docsnippets
