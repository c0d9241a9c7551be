package eventmonitor

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type r2PtrExit struct{ code uint32 }

func (p *r2PtrExit) Result() (uint32, time.Time, error) { return p.code, time.Time{}, nil }

type r2ExitSeen struct {
	code uint32
	at   time.Time
	err  error
}

// panicToErr now serves exitResult: a status whose Result panics or fails
// gives UnknownExitCode at the clock's now, with the panic or Result's error.
func TestReview2ExitResultOnPanicAndError(t *testing.T) {
	h := newHarness(t, HandlerFunc(func(context.Context, any) error { return nil }))
	h.clock.Step(time.Hour)
	now := h.clock.Now()
	seen := make(chan r2ExitSeen, 3)
	build := func(code uint32, at time.Time, err error) any {
		seen <- r2ExitSeen{code, at, err}
		return code
	}

	// Result panics: a nil *r2PtrExit.
	pch := make(chan *r2PtrExit, 1)
	pch <- nil
	<-WatchExitResult(context.Background(), h.m, "p", pch, build)
	got := <-seen
	assert.Equal(t, uint32(UnknownExitCode), got.code)
	assert.Equal(t, now, got.at)
	require.Error(t, got.err)
	assert.Contains(t, got.err.Error(), "reading the exit status panicked")

	// Result fails, with a code and time that must not be used.
	boom := errors.New("boom")
	ech := make(chan fakeExit, 1)
	ech <- fakeExit{code: 7, at: epoch.Add(-time.Minute), err: boom}
	<-WatchExitResult(context.Background(), h.m, "e", ech, build)
	got = <-seen
	assert.Equal(t, r2ExitSeen{UnknownExitCode, now, boom}, got)

	// A real status passes through untouched.
	ech <- fakeExit{code: 3, at: epoch.Add(-time.Minute)}
	<-WatchExitResult(context.Background(), h.m, "ok", ech, build)
	assert.Equal(t, r2ExitSeen{3, epoch.Add(-time.Minute), nil}, <-seen)

	// The builder panicking is a drop of nothing, counted once.
	ech <- fakeExit{code: 1}
	<-WatchExitResult(context.Background(), h.m, "bp", ech, func(uint32, time.Time, error) any { panic("bad builder") })
	drops := h.drops.all()
	require.Len(t, drops, 1)
	assert.ErrorIs(t, drops[0].Reason, ErrInvalidEvent)
	assert.Nil(t, drops[0].Events)
	h.settled(t)
	assertBalanced(t, h.m.Stats())
}

type r2Big struct {
	key string
	seq int
	_   [1 << 16]byte // big enough that the collector frees it promptly
}

// r2Collected runs the collector until the finalizer behind done ran.
func r2Collected(done *atomic.Bool) bool {
	for range 5 {
		runtime.GC()
		runtime.GC() // the first queues the finalizer, the second lets it run
		if done.Load() {
			return true
		}
	}
	return false
}

// keyq's queue is now a plain slice: an event handled (or popped into a
// call) must not stay reachable through the key's array while the key
// stays busy, nor after a failure put it back with slices.Insert.
func TestReview2PoppedEventNotRetained(t *testing.T) {
	gates := map[int]chan struct{}{}
	started := map[int]chan struct{}{}
	for i := 1; i <= 6; i++ {
		gates[i], started[i] = make(chan struct{}), make(chan struct{})
	}
	var failOnce sync.Once
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		seq := e.(*r2Big).seq
		select {
		case <-started[seq]:
		default:
			close(started[seq])
		}
		<-gates[seq]
		if seq == 2 {
			var err error
			failOnce.Do(func() { err = errors.New("once") })
			return err
		}
		return nil
	}), WithBackoff(time.Second, time.Minute))
	t.Cleanup(func() {
		for _, g := range gates {
			select {
			case <-g:
			default:
				close(g)
			}
		}
	})
	ptrs := make([]*atomic.Bool, 6)
	for i := 1; i <= 6; i++ {
		e := &r2Big{key: "k", seq: i}
		done := new(atomic.Bool)
		runtime.SetFinalizer(e, func(*r2Big) { done.Store(true) })
		ptrs[i-1] = done
		require.NoError(t, h.m.Submit("k", e))
	}
	<-started[1]
	close(gates[1])
	<-started[2]
	assert.True(t, r2Collected(ptrs[0]), "event 1, handled, still reachable while its key is busy")
	close(gates[2]) // fails: back at the head with slices.Insert, the key waits
	h.settled(t)
	require.Equal(t, 5, h.m.Stats().EventsInBackoff)
	h.clock.Step(time.Second) // replay: 2 succeeds now, 3 blocks
	<-started[3]
	assert.True(t, r2Collected(ptrs[1]), "event 2, failed then handled, still reachable")
	close(gates[3])
	<-started[4]
	assert.True(t, r2Collected(ptrs[2]), "event 3 still reachable")
	for i := 4; i <= 6; i++ {
		close(gates[i])
	}
	h.settled(t)
	for i, p := range ptrs {
		assert.True(t, r2Collected(p), "event %d still reachable once its key is idle", i+1)
	}
	assertBalanced(t, h.m.Stats())
}
