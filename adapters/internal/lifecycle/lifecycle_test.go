package lifecycle

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestCloseWaitsForTheWorkEntered: Close ends the context and the joined
// contexts at once, refuses new work, waits for the work entered to leave
// before it finishes, and gives a second caller the first one's result
// only once the first has finished.
func TestCloseWaitsForTheWorkEntered(t *testing.T) {
	c := New()
	if !c.Enter() {
		t.Fatal("an open Closer refused work")
	}
	joined, cancel := c.Join(context.Background())
	defer cancel()
	ran := make(chan struct{})
	c.Go(func() {
		<-c.Context().Done()
		close(ran)
	})

	finished := make(chan struct{})
	want := errors.New("finish failed")
	first := make(chan error, 1)
	go func() {
		first <- c.Close(func() error {
			close(finished)
			return want
		})
	}()
	select {
	case <-joined.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end the joined context")
	}
	<-ran
	if c.Enter() {
		t.Fatal("Enter admitted work after Close began")
	}
	if !c.Closed() {
		t.Fatal("Closed is false after Close began")
	}
	second := make(chan error, 1)
	go func() { second <- c.Close(nil) }()
	select {
	case <-finished:
		t.Fatal("Close finished while entered work had not left")
	case err := <-second:
		t.Fatalf("a second Close returned (%v) before the first finished", err)
	case <-time.After(50 * time.Millisecond):
	}
	c.Leave()
	for i, ch := range []chan error{first, second} {
		select {
		case err := <-ch:
			if !errors.Is(err, want) {
				t.Fatalf("Close call %d returned %v, want the finish's error", i+1, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("Close call %d did not return after the work left", i+1)
		}
	}
}

// TestJoinEndsWithItsParent: a joined context ends with its parent,
// without Close.
func TestJoinEndsWithItsParent(t *testing.T) {
	c := New()
	parent, cancelParent := context.WithCancel(context.Background())
	joined, cancel := c.Join(parent)
	defer cancel()
	cancelParent()
	select {
	case <-joined.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the joined context outlived its parent")
	}
	if c.Closed() || c.Context().Err() != nil {
		t.Fatal("the parent's end closed the Closer")
	}
}
