package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/containerd/log"
)

// TestContendersKeepOrderThroughRetries holds every contender to what the
// comparison assumes of it: each event handled once successfully, a key's
// events in the order submitted, and a failed event retried before the
// events behind it. Every third event fails its first call.
func TestContendersKeepOrderThroughRetries(t *testing.T) {
	const keys, perKey = 20, 10
	for _, timed := range []bool{false, true} {
		for _, c := range contenders {
			t.Run(fmt.Sprintf("%s/deadlines=%v", c.name, timed), func(t *testing.T) {
				s := settings{workers: 4, initialBackoff: time.Millisecond, maxBackoff: 10 * time.Millisecond, tick: time.Millisecond}
				if timed {
					s.callTimeout = time.Minute
				}
				var mu sync.Mutex
				failed := map[*event]bool{}
				handled := map[string][]int{}
				handledAll := 0
				seq := map[*event]int{}
				all := make(chan struct{})
				contender := c.new(func(ctx context.Context, e *event) error {
					deadline, ok := ctx.Deadline()
					if want := timed; ok != want { // eventmonitor too: WithHandleTimeout(0) without one
						t.Errorf("call with a deadline: %v, want %v", ok, want)
					}
					if timed && time.Until(deadline) <= s.callTimeout/2 {
						t.Errorf("deadline %v away, want the %v asked for", time.Until(deadline), s.callTimeout)
					}
					mu.Lock()
					defer mu.Unlock()
					n := seq[e]
					if n%3 == 0 && !failed[e] {
						failed[e] = true
						return errFail
					}
					handled[e.key] = append(handled[e.key], n)
					if handledAll++; handledAll == keys*perKey {
						close(all)
					}
					return nil
				}, s)
				defer contender.stop()

				var events []*event
				mu.Lock()
				for n := range perKey {
					for k := range keys {
						e := &event{key: fmt.Sprintf("key-%d", k)}
						seq[e] = n
						events = append(events, e)
					}
				}
				mu.Unlock()
				for _, e := range events {
					contender.submit(e)
				}
				select {
				case <-all:
				case <-time.After(10 * time.Second):
					t.Fatal("not every event was handled within 10 s")
				}
				mu.Lock()
				defer mu.Unlock()
				want := make([]int, perKey)
				for i := range want {
					want[i] = i
				}
				for key, got := range handled {
					if !slices.Equal(got, want) {
						t.Errorf("%s handled %v, want %v", key, got, want)
					}
				}
			})
		}
	}
}

func TestMain(m *testing.M) {
	log.L.Logger.SetLevel(log.FatalLevel) // the failures are on purpose: their error lines are not news
	os.Exit(m.Run())
}
