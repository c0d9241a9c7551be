package eventmonitor_test

// Helpers of the tests through the public API (api_test.go, regress_test.go):
// the black-box counterpart of harness_test.go.

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/eventmonitor/eventmonitor"
)

// seqEvent is a key and its sequence number.
type seqEvent struct {
	Key string
	Seq int
}

func (e seqEvent) String() string { return fmt.Sprintf("%s/%d", e.Key, e.Seq) }

// waitUntil polls cond every millisecond until it holds or within has passed,
// and reports whether it held.
func waitUntil(within time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// closesWithin reports whether ch closes within d.
func closesWithin(ch <-chan struct{}, d time.Duration) bool {
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
}

// quietLogger is a logger that writes nowhere; tests that read logs set
// their own.
func quietLogger() *logrus.Entry {
	l := logrus.New()
	l.Out = io.Discard
	return logrus.NewEntry(l)
}

// dropRecorder records what reached the drop handler.
type dropRecorder struct {
	mu    sync.Mutex
	drops []eventmonitor.Drop
}

func (r *dropRecorder) record(d eventmonitor.Drop) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.drops = append(r.drops, d)
}

// all returns every Drop recorded, in order.
func (r *dropRecorder) all() []eventmonitor.Drop {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]eventmonitor.Drop(nil), r.drops...)
}

// reason returns the reason event was dropped for, and whether it was.
func (r *dropRecorder) reason(event any) (error, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, d := range r.drops {
		for _, e := range d.Events {
			if e == event {
				return d.Reason, true
			}
		}
	}
	return nil, false
}

func (r *dropRecorder) count(match func(any) bool) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, d := range r.drops {
		for _, e := range d.Events {
			if match(e) {
				n++
			}
		}
	}
	return n
}

// requireDroppedStopped fails t unless event reached the drop handler with a
// reason wrapping ErrStopped.
func (r *dropRecorder) requireDroppedStopped(t *testing.T, event any) {
	t.Helper()
	reason, ok := r.reason(event)
	switch {
	case !ok:
		t.Errorf("event %v never reached the drop handler", event)
	case !errors.Is(reason, eventmonitor.ErrStopped):
		t.Errorf("event %v dropped with %v, want an error wrapping ErrStopped", event, reason)
	}
}
