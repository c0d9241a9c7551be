package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"
	testclock "k8s.io/utils/clock/testing"
)

// The guards around user code (errors.go): a panic, a panic(nil) under
// GODEBUG=panicnil=1 and runtime.Goexit, in what user code returns (an
// error whose methods panic) as in the code itself, through convert,
// buildExit and Run's resync hook.

// nilPanickingErr is an error whose Error panics with nil: under
// GODEBUG=panicnil=1, recover returns nil for it.
type nilPanickingErr struct{}

func (nilPanickingErr) Error() string { panic(nil) }

// ptrErr, as a typed nil, is an error whose Error panics (nil deref).
type ptrErr struct{ msg string }

func (e *ptrErr) Error() string { return e.msg }

// unwrapPanics panics in Unwrap, with nil if nilPanic.
type unwrapPanics struct{ nilPanic bool }

func (unwrapPanics) Error() string { return "unwrap panics" }
func (e unwrapPanics) Unwrap() error {
	if e.nilPanic {
		panic(nil)
	}
	panic("unwrap")
}

// isPanics answers Is(ErrUnsupportedEvent) with unsupported and panics
// for any other target (with nil if nilPanic); with unsupported its Unwrap
// panics too, which errors.Is must never reach.
type isPanics struct{ unsupported, nilPanic bool }

func (isPanics) Error() string { return "is panics" }
func (e isPanics) Is(target error) bool {
	if target == ErrUnsupportedEvent {
		return e.unsupported
	}
	if e.nilPanic {
		panic(nil)
	}
	panic("is")
}
func (e isPanics) Unwrap() error {
	if e.unsupported {
		panic("unwrap after Is said unsupported")
	}
	return nil
}

// assertDropsAccounted checks the Stats identity and that every drop was handed
// to the drop handler once (each drop here is of one input).
func assertDropsAccounted(t *testing.T, h *harness) Stats {
	t.Helper()
	s := h.m.Stats()
	assertBalanced(t, s)
	n := 0
	for _, d := range h.drops.all() {
		n += max(1, len(d.Events))
	}
	assert.Equal(t, s.Dropped, uint64(n), "drop handler saw %d, Stats %+v", n, s)
	return s
}

// wrapsADropSentinel reports whether reason wraps one of the Drop sentinels.
func wrapsADropSentinel(reason error) bool {
	for _, s := range []error{ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull, ErrStopped} {
		if errors.Is(reason, s) {
			return true
		}
	}
	return false
}

// takeOne starts h's reader on a fake stream and sends it one envelope
// for "c1", waiting until it was counted and the monitor is idle.
func takeOne(t *testing.T, h *harness) {
	t.Helper()
	stream := newFakeStream()
	h.m.Subscribe(stream)
	h.m.Start()
	sub := <-stream.newSub
	sub.send(t, envelope(t, "ns", wrapperspb.String("c1")))
	waitFor(t, func() bool { return h.m.Stats().Received == 1 }, "the envelope was never counted")
	h.settled(t)
}

// ---- errOnPanic and runtime.Goexit ----------------------------------------

// errOnPanic on its own: fn that Goexits ends the goroutine (errOnPanic does not
// return, whatever its deferred func set), also when a defer in fn panics
// after the Goexit began and errOnPanic's recover takes that panic: the
// runtime resumes the Goexit.
func TestGuardedDoesNotReturnFromAGoexit(t *testing.T) {
	for _, late := range []bool{false, true} {
		t.Run(fmt.Sprintf("latePanic=%v", late), func(t *testing.T) {
			done := make(chan string, 1)
			go func() {
				outcome := "goroutine ended; errOnPanic never returned"
				defer func() { done <- outcome }()
				err := errOnPanic(errConverterPanic, func() error {
					if late {
						defer func() { panic("late") }()
					}
					runtime.Goexit()
					return nil
				})
				outcome = fmt.Sprintf("errOnPanic returned %v", err)
			}()
			select {
			case got := <-done:
				assert.Equal(t, "goroutine ended; errOnPanic never returned", got)
			case <-time.After(10 * time.Second):
				t.Fatal("the goroutine never ended")
			}
		})
	}
}

type lateGoexitStatus struct{ late bool }

func (s lateGoexitStatus) Result() (uint32, time.Time, error) {
	if s.late {
		defer func() { panic("late") }()
	}
	runtime.Goexit()
	return 0, time.Time{}, nil
}

// ---- convert ---------------------------------------------------------------

// Every converter outcome is ignored (ErrUnsupportedEvent), accepted, or
// a drop whose reason wraps a sentinel; a panic in the error's own methods
// (errors.Is) is never taken for ignored.
func TestConvertReasons(t *testing.T) {
	for _, tc := range []struct {
		name    string
		event   bool
		err     error
		ignored bool
		want    error // the drop's sentinel; nil: handled or ignored
	}{
		{"plain error", true, errors.New("bad"), false, ErrDecode},
		{"nil event", false, nil, false, ErrInvalidEvent},
		{"typed nil whose Error panics", true, (*ptrErr)(nil), false, ErrDecode},
		{"Unwrap panics", true, unwrapPanics{}, false, errConverterPanic},
		{"Is panics after not unsupported", true, isPanics{}, false, errConverterPanic},
		{"Is says unsupported", false, isPanics{unsupported: true}, true, nil},
		{"wraps ErrInvalidEvent", true, fmt.Errorf("x: %w", ErrInvalidEvent), false, ErrInvalidEvent},
		{"unsupported", false, fmt.Errorf("x: %w", ErrUnsupportedEvent), true, nil},
		{"ok", true, nil, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conv := ConverterFunc(func(p typeurl.Any) (string, any, error) {
				var event any
				if tc.event {
					event = ev{"c1", 1}
				}
				return "c1", event, tc.err
			})
			r := newRecorder()
			h := newHarness(t, r, WithConverter(conv), WithLogger(quietLogger()))
			takeOne(t, h)
			s := assertDropsAccounted(t, h)
			drops := h.drops.all()
			switch {
			case tc.ignored:
				assert.Equal(t, uint64(1), s.Ignored, "%+v", s)
				assert.Empty(t, drops)
			case tc.want == nil:
				assert.Equal(t, uint64(1), s.Handled, "%+v", s)
				assert.Empty(t, drops)
			default:
				require.Len(t, drops, 1, "%+v", s)
				assert.ErrorIs(t, drops[0].Reason, tc.want)
				assert.True(t, wrapsADropSentinel(drops[0].Reason), "%v", drops[0].Reason)
				assert.Zero(t, s.Ignored)
				assert.Zero(t, s.Handled)
			}
		})
	}
}

// Under GODEBUG=panicnil=1, an Unwrap or Is that panics with nil in
// errors.Is is still a converter panic: a drop wrapping ErrInvalidEvent,
// not ignored, not handled.
func TestPanicNilInErrorsIsIsAConverterPanic(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilInErrorsIsIsAConverterPanic", false, func(t *testing.T) (string, bool) {
		var out string
		ok := true
		for _, err := range []error{unwrapPanics{nilPanic: true}, isPanics{nilPanic: true}} {
			conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "c1", ev{"c1", 1}, err })
			h := newHarness(t, newRecorder(), WithConverter(conv), WithLogger(quietLogger()))
			takeOne(t, h)
			s := h.m.Stats()
			drops := h.drops.all()
			good := len(drops) == 1 && errors.Is(drops[0].Reason, errConverterPanic) &&
				s.Ignored == 0 && s.Handled == 0 && accounted(s) == s.Received
			ok = ok && good
			out += fmt.Sprintf("[%T: %+v drops=%d] ", err, s, len(drops))
			h.m.Stop()
		}
		return out, ok
	})
}

// ---- checked under panicnil: errors whose Error panics with nil -----------

// Under GODEBUG=panicnil=1 a handler error whose Error panics with nil
// fails the call, as it does without panicnil: checked tells the nil panic
// by Error not returning.
func TestPanicNilErrorFromAHandlerIsAFailure(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilErrorFromAHandlerIsAFailure", false, func(t *testing.T) (string, bool) {
		var calls atomic.Int32
		h := newHarness(t, HandlerFunc(func(context.Context, any) error {
			if calls.Add(1) == 1 {
				return nilPanickingErr{}
			}
			return nil
		}), WithLogger(quietLogger()))
		h.submit(t, ev{"a", 1})
		h.settled(t)
		s := h.m.Stats()
		return fmt.Sprintf("%+v inBackoff=%v", s, h.m.InBackoff("a")),
			s.Failed == 1 && s.Handled == 0 && h.m.InBackoff("a")
	})
}

// The same error from the converter: the envelope is dropped with
// ErrDecode, not accepted and handled.
func TestPanicNilErrorFromTheConverterIsADrop(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilErrorFromTheConverterIsADrop", false, func(t *testing.T) (string, bool) {
		conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "c1", ev{"c1", 1}, nilPanickingErr{} })
		h := newHarness(t, newRecorder(), WithConverter(conv), WithLogger(quietLogger()))
		takeOne(t, h)
		s := h.m.Stats()
		drops := h.drops.all()
		return fmt.Sprintf("%+v drops=%d", s, len(drops)),
			len(drops) == 1 && errors.Is(drops[0].Reason, ErrDecode) && s.Handled == 0
	})
}

// The same error from ExitStatus.Result: the builder is told
// UnknownExitCode, the clock's now and an error, not that the status was
// real.
func TestPanicNilErrorFromResultReachesTheBuilder(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilErrorFromResultReachesTheBuilder", false, func(t *testing.T) (string, bool) {
		h := newHarness(t, newRecorder(), WithLogger(quietLogger()))
		h.clock.SetTime(epoch.Add(time.Hour))
		code, at, got := builderSees(t, h, fakeExit{code: 3, at: epoch, err: nilPanickingErr{}})
		return fmt.Sprintf("builder got (%d, %v, %v)", code, at, got),
			code == UnknownExitCode && at.Equal(epoch.Add(time.Hour)) && got != nil
	})
}

// The same error sent on a subscription's errs: Start's channel reports
// an error, not closing silently as it does only at Stop and Shutdown.
func TestPanicNilStreamErrorIsReportedByStart(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilStreamErrorIsReportedByStart", false, func(t *testing.T) (string, bool) {
		h := newHarness(t, newRecorder(), WithConverter(testConverter), WithLogger(quietLogger()))
		stream := newFakeStream()
		h.m.Subscribe(stream)
		errCh := h.m.Start()
		(<-stream.newSub).errs <- nilPanickingErr{}
		err, open := startResult(t, errCh)
		return fmt.Sprintf("open=%v err=%v stopping=%v", open, err != nil, h.stopping()), open && err != nil
	})
}

// ---- buildExit --------------------------------------------------------------

// What WatchExitResult's builder sees, beside TestExitStatusProblemsReachTheBuilder:
// a typed nil error whose Error panics becomes an error (UnknownExitCode,
// now), a panicking Result too.
func TestExitBuilderSees(t *testing.T) {
	for _, tc := range []struct {
		name string
		s    ExitStatus
		code uint32
		now  bool
		err  error // nil: none; errAny: any
	}{
		{"real", fakeExit{code: 3, at: epoch}, 3, false, nil},
		{"typed nil error", fakeExit{code: 3, at: epoch, err: (*ptrErr)(nil)}, UnknownExitCode, true, errAnyError},
		{"Result panics", panickyStatus{}, UnknownExitCode, true, errExitStatusPanic},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, newRecorder(), WithLogger(quietLogger()))
			h.clock.SetTime(epoch.Add(time.Hour))
			code, at, got := builderSees(t, h, tc.s)
			s := assertDropsAccounted(t, h)
			assert.Equal(t, uint64(1), s.Handled)
			assert.Equal(t, tc.code, code)
			if tc.now {
				assert.True(t, at.Equal(epoch.Add(time.Hour)), "%v", at)
			} else {
				assert.True(t, at.Equal(epoch), "%v", at)
			}
			switch tc.err {
			case nil:
				assert.NoError(t, got)
			case errAnyError:
				require.Error(t, got)
				assert.NotPanics(t, func() { _ = got.Error() })
			default:
				assert.ErrorIs(t, got, tc.err)
			}
		})
	}
}

var errAnyError = errors.New("any error")

// Under panicnil a Result that panics with nil gives the builder
// UnknownExitCode and an error saying it panicked, not ErrNoExitStatus
// ("closed without a status"): a status was received.
func TestPanicNilResultGivesUnknownCode(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilResultGivesUnknownCode", false, func(t *testing.T) (string, bool) {
		h := newHarness(t, newRecorder(), WithLogger(quietLogger()))
		code, _, got := builderSees(t, h, panicNilStatus{})
		return fmt.Sprintf("(%d, %v)", code, got), code == UnknownExitCode && errors.Is(got, errExitStatusPanic)
	})
}

// ---- runOnce and the resync hook --------------------------------------------

// runThroughAnOutage runs Run on a fresh stream, breaks its first subscription and
// delivers one envelope on the second, so the resync hook starts.
func runThroughAnOutage(t *testing.T, h *harness, ctx context.Context) (runErr <-chan error) {
	t.Helper()
	stream := newFakeStream()
	ch := make(chan error, 1)
	go func() { ch <- h.m.Run(ctx, stream) }()
	(<-stream.newSub).errs <- errors.New("broken")
	waitFor(t, h.clock.HasWaiters, "Run never waited to re-subscribe")
	h.clock.Step(time.Second)
	(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.String("c1")))
	return ch
}

// A resync hook that calls Shutdown or Stop (which end Run's reading) does
// not deadlock with runOnce's deferred wait for it; Run returns ErrStopped,
// no fake-clock timer is left, and (harness cleanup) no goroutine.
func TestResyncHookStopsTheMonitor(t *testing.T) {
	for _, how := range []string{"Shutdown", "Stop"} {
		t.Run(how, func(t *testing.T) {
			var h *harness
			hookErr := make(chan error, 1)
			h = newHarness(t, newRecorder(), WithConverter(testConverter), WithLogger(quietLogger()),
				WithResubscribe(time.Second, time.Second),
				WithResync(func(ctx context.Context) error {
					var err error
					if how == "Shutdown" {
						err = h.m.Shutdown(context.Background())
					} else {
						h.m.Stop()
					}
					hookErr <- err
					return err
				}))
			runErr := runThroughAnOutage(t, h, context.Background())
			require.ErrorIs(t, awaitErr(t, runErr), ErrStopped)
			assert.NoError(t, <-hookErr)
			assert.False(t, h.clock.HasWaiters(), "a fake-clock timer outlived Run")
			assertDropsAccounted(t, h)
		})
	}
}

// A resync hook that ends its goroutine, panics, or blocks until its ctx
// ends is the hook's own: Run goes on reading and returns once ctx ends.
func TestResyncHookGoexitAndPanic(t *testing.T) {
	for _, how := range []string{"goexit", "goexit+late panic", "panic", "blocks until ctx ends"} {
		t.Run(how, func(t *testing.T) {
			ran := make(chan struct{})
			r := newRecorder()
			h := newHarness(t, r, WithConverter(testConverter), WithLogger(quietLogger()),
				WithResubscribe(time.Second, time.Second),
				WithResync(func(ctx context.Context) error {
					close(ran)
					switch how {
					case "goexit+late panic":
						defer func() { panic("late") }()
						runtime.Goexit()
					case "goexit":
						runtime.Goexit()
					case "blocks until ctx ends":
						<-ctx.Done()
						return ctx.Err()
					}
					panic("hook")
				}))
			ctx, cancel := context.WithCancel(context.Background())
			runErr := runThroughAnOutage(t, h, ctx)
			awaitClosed(t, ran, "the hook")
			waitFor(t, func() bool { return len(r.handledList()) == 1 }, "the envelope was never handled")
			cancel()
			require.NoError(t, awaitErr(t, runErr))
			h.settled(t) // the call's deadline is a scheduler timer until it settles
			assert.False(t, h.clock.HasWaiters())
			assertDropsAccounted(t, h)
		})
	}
}

// A resync hook that ignores its ctx holds Run past ctx's end, as
// WithResync says: Run waits for it.
func TestRunWaitsForAHookIgnoringItsCtx(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	h := newHarness(t, newRecorder(), WithConverter(testConverter), WithLogger(quietLogger()),
		WithResubscribe(time.Second, time.Second),
		WithResync(func(context.Context) error { close(started); <-release; return nil }))
	ctx, cancel := context.WithCancel(context.Background())
	runErr := runThroughAnOutage(t, h, ctx)
	awaitClosed(t, started, "the hook")
	cancel()
	waitFor(t, func() bool { return goroutinesIn("(*Monitor).runOnce", "(*WaitGroup).Wait") == 1 },
		"Run did not wait for its hook")
	select {
	case err := <-runErr:
		t.Fatalf("Run returned %v with its hook still running", err)
	default:
	}
	close(release)
	require.NoError(t, awaitErr(t, runErr))
	h.settled(t) // the call's deadline is a scheduler timer until it settles
	assert.False(t, h.clock.HasWaiters())
}

// Under panicnil a resync hook that panics with nil is logged as a failed
// resync, and Run goes on.
func TestPanicNilResyncHookIsLogged(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilResyncHookIsLogged", false, func(t *testing.T) (string, bool) {
		r := newRecorder()
		h := newHarness(t, r, WithConverter(testConverter), WithResubscribe(time.Second, time.Second),
			WithResync(func(context.Context) error { panic(nil) }))
		ctx, cancel := context.WithCancel(context.Background())
		runErr := runThroughAnOutage(t, h, ctx)
		waitFor(t, func() bool {
			lines := h.entries("resync after re-subscription failed")
			return len(lines) > 0 && errors.Is(lines[0].Data["error"].(error), errResyncPanic)
		}, "no warning")
		cancel()
		err := awaitErr(t, runErr)
		return fmt.Sprintf("Run: %v", err), err == nil
	})
}

// builderSees hands status to WatchExitResult for key "c1" and returns
// what its builder was given, once the exit was handled.
func builderSees(t *testing.T, h *harness, status ExitStatus) (code uint32, at time.Time, err error) {
	t.Helper()
	exitCh := make(chan ExitStatus, 1)
	exitCh <- status
	awaitClosed(t, WatchExitResult(context.Background(), h.m, "c1", exitCh, func(c uint32, a time.Time, e error) any {
		code, at, err = c, a, e
		return exitEvent{"c1", c, a}
	}), "the watcher")
	h.settled(t)
	return code, at, err
}

// assertOneDrop checks, once settled, that the one input taken in was
// dropped once, for want and not for notWant, and returns the Stats.
func assertOneDrop(t *testing.T, h *harness, want, notWant error) Stats {
	t.Helper()
	h.settled(t)
	s := assertDropsAccounted(t, h)
	drops := h.drops.all()
	require.Len(t, drops, 1, "%+v", s)
	assert.ErrorIs(t, drops[0].Reason, want)
	assert.NotErrorIs(t, drops[0].Reason, notWant)
	assert.Equal(t, uint64(1), s.Received)
	return s
}

// goexitErr is an error whose Error ends the goroutine (t.FailNow in a
// test's error type), after which, if late, a deferred func panics.
type goexitErr struct{ late bool }

func (e goexitErr) Error() string {
	if e.late {
		defer func() { panic("late") }()
	}
	runtime.Goexit()
	return "unreachable"
}

// panicErr is an error whose Error panics with v.
type panicErr struct{ v any }

func (e panicErr) Error() string { panic(e.v) }

// endedWithoutReturning runs f on a goroutine of its own and reports whether that
// goroutine ended without f returning.
func endedWithoutReturning(t *testing.T, f func() string) (ended bool, got string) {
	t.Helper()
	done := make(chan string, 1)
	go func() {
		outcome := "\x00ended"
		defer func() { done <- outcome }()
		outcome = f()
	}()
	select {
	case got = <-done:
		return got == "\x00ended", got
	case <-time.After(10 * time.Second):
		t.Fatal("the goroutine never ended")
		return false, ""
	}
}

// A Goexit in recovering's fn, in an error's Error under checked, in a
// panic value's Error under panicked and errOnPanic, with or without a panic
// raised after it began: nothing after recovering runs.
func TestRecoveringNeverReturnsFromAGoexit(t *testing.T) {
	for _, late := range []bool{false, true} {
		cases := map[string]func() string{
			"recovering": func() string {
				r, ok := recovering(func() { _ = goexitErr{late}.Error() })
				return fmt.Sprintf("recovering returned (%v, %v)", r, ok)
			},
			"checked": func() string { return fmt.Sprintf("checked returned %v", checked(goexitErr{late})) },
			"panicked": func() string {
				return "panicked returned " + panicked(goexitErr{late})
			},
			"errOnPanic's panic value": func() string {
				err := errOnPanic(errConverterPanic, func() error { panic(goexitErr{late}) })
				return fmt.Sprintf("errOnPanic returned %v", err)
			},
			"errOnPanic's checked error": func() string {
				err := errOnPanic(errConverterPanic, func() error { return checked(goexitErr{late}) })
				return fmt.Sprintf("errOnPanic returned %v", err)
			},
		}
		for name, f := range cases {
			t.Run(fmt.Sprintf("%s/late=%v", name, late), func(t *testing.T) {
				ended, got := endedWithoutReturning(t, f)
				assert.True(t, ended, "%s", got)
			})
		}
	}
}

// logOnPanic whose fn Goexits, directly or through a panic value whose Error
// Goexits: the goroutine ends and no "panicked" line is logged.
func TestLogOnPanicGoexitLogsNothing(t *testing.T) {
	for name, fn := range map[string]func(){
		"Goexit":                   runtime.Goexit,
		"Goexit, late panic":       func() { _ = goexitErr{true}.Error() },
		"panic value Goexits":      func() { panic(goexitErr{}) },
		"panic value Goexits late": func() { panic(goexitErr{true}) },
	} {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t, newRecorder())
			ended, got := endedWithoutReturning(t, func() string {
				h.m.logOnPanic("drop handler", "k", fn)
				return "logOnPanic returned"
			})
			assert.True(t, ended, "%s", got)
			assert.Zero(t, loggedLines(h, "drop handler panicked"))
		})
	}
}

// loggedLines counts h's log lines that begin with prefix.
func loggedLines(h *harness, prefix string) int {
	n := 0
	for _, e := range h.logs.AllEntries() {
		if strings.HasPrefix(e.Message, prefix) {
			n++
		}
	}
	return n
}

// A panic in a panic value's Error, once, twice and three times nested:
// panicked does not crash and says something.
func TestPanickedNested(t *testing.T) {
	for _, tc := range []struct {
		name string
		v    any
		want string
	}{
		{"once", panicErr{"boom"}, "boom"},
		{"twice", panicErr{panicErr{"inner"}}, "panicErr"},
		{"thrice", panicErr{panicErr{panicErr{"innermost"}}}, "panicErr"},
		{"typed nil", (*ptrErr)(nil), "nil"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s string
			require.NotPanics(t, func() { s = panicked(tc.v) })
			assert.Contains(t, s, tc.want)
			var err error
			require.NotPanics(t, func() { err = checked(tc.v.(error)) })
			require.Error(t, err)
			require.NotPanics(t, func() { s = err.Error() })
			assert.NotEmpty(t, s)
		})
	}
}

// panicNilMetrics counts Dropped calls, and panics with nil in the first
// if panicFirst.
type panicNilMetrics struct {
	dropped    atomic.Int32
	panicFirst bool
}

func (*panicNilMetrics) HandlerDone(time.Duration, error) {}
func (*panicNilMetrics) Recovered(time.Duration)          {}
func (m *panicNilMetrics) Dropped(error, int) {
	if m.dropped.Add(1) == 1 && m.panicFirst {
		panic(nil)
	}
}

// Under panicnil, a drop handler and Metrics.Dropped that panic(nil) are
// each logged once, and every later drop is still handed over: from a
// worker's report, and from Stop's emit loop.
func TestLogOnPanicPanicNilLogsOnceAndGoesOn(t *testing.T) {
	inPanicNilChild(t, "TestLogOnPanicPanicNilLogsOnceAndGoesOn", false, func(t *testing.T) (string, bool) {
		var states []string
		ok := true
		for _, atStop := range []bool{false, true} {
			calls := atomic.Int32{}
			mt := &panicNilMetrics{panicFirst: true}
			opts := []Option{WithMaxAttempts(1), WithWorkers(1), WithMetrics(mt),
				WithDropHandler(func(Drop) {
					if calls.Add(1) == 1 {
						panic(nil)
					}
				})}
			if atStop {
				opts = append(opts, WithDeferredStart())
			}
			h := newHarness(t, HandlerFunc(func(context.Context, any) error { return errors.New("fails") }), opts...)
			h.submit(t, ev{"a", 1}, ev{"b", 1}, ev{"c", 1})
			if atStop {
				h.m.Stop()
			} else {
				h.settled(t)
			}
			s := h.m.Stats()
			dh, ml := loggedLines(h, "drop handler panicked"), loggedLines(h, "Metrics panicked")
			good := s.Dropped == 3 && calls.Load() == 3 && mt.dropped.Load() == 3 && dh == 1 && ml == 1 &&
				s.Received == accounted(s)
			ok = ok && good
			states = append(states, fmt.Sprintf("atStop=%v %+v dropHandler=%d metrics=%d lines=%d/%d",
				atStop, s, calls.Load(), mt.dropped.Load(), dh, ml))
		}
		return strings.Join(states, "; "), ok
	})
}

// goexitInDroppedMetrics panics in Dropped with a value whose Error Goexits.
type goexitInDroppedMetrics struct{ late bool }

func (goexitInDroppedMetrics) HandlerDone(time.Duration, error) {}
func (goexitInDroppedMetrics) Recovered(time.Duration)          {}
func (m goexitInDroppedMetrics) Dropped(error, int)             { panic(goexitErr{m.late}) }

// A handler whose error's Error Goexits (checked in invoke) fails once, as
// a Goexit in the handler does; the slot goes on.
func TestHandlerErrorGoexits(t *testing.T) {
	for _, late := range []bool{false, true} {
		t.Run(fmt.Sprintf("late=%v", late), func(t *testing.T) {
			h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
				if e == (ev{"a", 1}) {
					return goexitErr{late}
				}
				return nil
			}), WithWorkers(1))
			bad := slotCheck(h.m)
			h.submit(t, ev{"a", 1}, ev{"b", 1})
			h.settled(t)
			s := h.m.Stats()
			assert.Equal(t, uint64(1), s.Failed)
			assert.Equal(t, uint64(1), s.Handled)
			assert.True(t, h.m.InBackoff("a"))
			assert.Equal(t, 1, loggedLines(h, "event handler panicked"), "invoke's own line, once")
			assert.Empty(t, bad())
			assertBalanced(t, s)
		})
	}
}

// Under panicnil, a handler that panics with a value whose Error panics
// with nil, and a converter that does: settled once, Stats balance.
func TestPanicNilInsideAPanicValue(t *testing.T) {
	inPanicNilChild(t, "TestPanicNilInsideAPanicValue", false, func(t *testing.T) (string, bool) {
		h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
			if e == (ev{"a", 1}) {
				panic(panicErr{nil})
			}
			return nil
		}), WithWorkers(1), WithConverter(ConverterFunc(func(typeurl.Any) (string, any, error) {
			panic(panicErr{nil})
		})))
		h.submit(t, ev{"a", 1}, ev{"b", 1})
		h.settled(t)
		takeOneMore := func() {
			stream := newFakeStream()
			h.m.Subscribe(stream)
			h.m.Start()
			(<-stream.newSub).send(t, envelope(t, "ns", wrapperspb.String("c1")))
			waitFor(t, func() bool { return h.m.Stats().Received == 3 }, "the envelope was never counted")
			h.settled(t)
		}
		takeOneMore()
		s := h.m.Stats()
		drops := h.drops.all()
		return fmt.Sprintf("%+v drops=%d", s, len(drops)),
			s.Failed == 1 && s.Handled == 1 && s.Dropped == 1 && len(drops) == 1 &&
				errors.Is(drops[0].Reason, errConverterPanic) && s.Received == accounted(s)
	})
}

// Under panicnil, a Goexit whose late defer panics with nil (recovered as
// nil, as in a Goexit): recovering, checked and logOnPanic still never return.
func TestLatePanicNilAfterGoexit(t *testing.T) {
	inPanicNilChild(t, "TestLatePanicNilAfterGoexit", false, func(t *testing.T) (string, bool) {
		h := newHarness(t, newRecorder())
		exit := func() {
			defer func() { panic(nil) }()
			runtime.Goexit()
		}
		var bad []string
		for name, f := range map[string]func() string{
			"recovering": func() string { r, ok := recovering(exit); return fmt.Sprint("returned ", r, ok) },
			"errOnPanic": func() string {
				return fmt.Sprint("returned ", errOnPanic(errConverterPanic, func() error { exit(); return nil }))
			},
			"logOnPanic": func() string { h.m.logOnPanic("drop handler", "k", exit); return "returned" },
		} {
			if ended, got := endedWithoutReturning(t, f); !ended {
				bad = append(bad, name+" "+got)
			}
		}
		if n := loggedLines(h, "drop handler panicked"); n != 0 {
			bad = append(bad, fmt.Sprintf("%d panicked lines", n))
		}
		return strings.Join(bad, "; "), len(bad) == 0
	})
}

// panicValue's Error ends the goroutine.
type goexitInErrorValue struct{}

func (goexitInErrorValue) Error() string { runtime.Goexit(); return "" }

// A handler panics with a value whose Error ends the goroutine (formatting
// the panic in invoke's defer): the call settles once.
func TestAPanicValueWhoseErrorGoexitsSettlesOnce(t *testing.T) {
	calls := atomic.Int32{}
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		if calls.Add(1) == 1 {
			panic(goexitInErrorValue{})
		}
		return nil
	}), WithLogger(quietLogger()), WithWorkers(1))
	bad := slotCheck(h.m)
	h.submit(t, ev{"a", 1}, ev{"b", 1})
	h.settled(t)
	s := h.m.Stats()
	assert.Equal(t, uint64(1), s.Failed)
	assert.Equal(t, uint64(1), s.Handled)
	assertNoSlotLeft(t, h.m, bad, s)
}

// A handler that panics with an empty string: the error does not say the
// value "cannot be printed" (only a value whose formatting panics cannot).
func TestAnEmptyPanicValueIsPrinted(t *testing.T) {
	var got atomic.Value
	h := newHarness(t, HandlerFunc(func(ctx context.Context, e any) error {
		panic("")
	}), WithLogger(quietLogger()), WithMaxAttempts(1), WithDropHandler(func(d Drop) { got.Store(d.Reason) }))
	h.submit(t, ev{"a", 1})
	h.settled(t)
	reason, _ := got.Load().(error)
	require.Error(t, reason)
	assert.True(t, errors.Is(reason, ErrHandlerPanic))
	assert.NotContains(t, reason.Error(), "cannot be printed", "panic(\"\") was printed fine: it is empty")
}

// panickyClock panics in Now when called from the scheduler's pass once
// broken is set: a bug under mu, or a user clock that fails.
type panickyClock struct {
	*testclock.FakeClock
	broken atomic.Bool
}

func (c *panickyClock) Now() time.Time {
	if c.broken.Load() {
		pcs := make([]uintptr, 32)
		frames := runtime.CallersFrames(pcs[:runtime.Callers(2, pcs)])
		for {
			f, more := frames.Next()
			if f.Function == "github.com/eventmonitor/eventmonitor.(*Monitor).schedule" {
				panic("the clock broke in the scheduler's pass")
			}
			if !more {
				break
			}
		}
	}
	return c.FakeClock.Now()
}

// A panic in the scheduler's pass, raised while it holds mu (a user clock,
// or any bug under mu), crashes the process with its message: the
// scheduler's hand-over after a log hook's Goexit does not take it for one
// (it would take mu again and hang the monitor silently).
func TestAPanicUnderMuInTheSchedulerCrashes(t *testing.T) {
	if inCrashChild(t) {
		clk := &panickyClock{FakeClock: testclock.NewFakeClock(epoch)}
		r := newRecorder()
		r.fail(ev{"a", 1}, 1)
		m, err := New(r, WithClock(clk), WithLogger(quietLogger()))
		require.NoError(t, err)
		require.NoError(t, m.Submit("a", ev{"a", 1}))
		require.NoError(t, m.WaitIdle(context.Background()))
		clk.broken.Store(true)
		clk.Step(time.Second) // the retry's timer fires: the pass panics under mu
		fmt.Println("CHILD: stepped; a crash should follow")
		select {} // the panic ends the process, or nothing ever does
	}
	out := runCrashChild(t) // a hang: mu never released, the panic never printed
	assert.Contains(t, out, "panic: the clock broke", "%s", out)
}

// crashChildEnv names the test whose child process this is (runCrashChild).
const crashChildEnv = "EVENTMONITOR_CRASH_CHILD"

// inCrashChild reports whether this process is the child runCrashChild
// started for t, to run t's scenario, which should crash it.
func inCrashChild(t *testing.T) bool { return os.Getenv(crashChildEnv) == t.Name() }

// runCrashChild runs t again in a child process, where inCrashChild is
// true, and returns its output; it fails t if the child runs 10 s.
func runCrashChild(t *testing.T) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashChildEnv+"="+t.Name())
	out, _ := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "the child hung:\n%s", out)
	return string(out)
}

// flakyUnwrapErr's Unwrap panics from its fourth call on: a stateful
// error (a lazily built cause, a field another goroutine sets), whose
// methods convert ran three times under the converter's guard.
type flakyUnwrapErr struct{ calls atomic.Int32 }

func (e *flakyUnwrapErr) Error() string { return "flaky" }
func (e *flakyUnwrapErr) Unwrap() error {
	if e.calls.Add(1) >= 4 {
		panic("Unwrap panics")
	}
	return nil
}

// convert tells an ignored type with errors.Is under the converter's guard,
// and ingest runs no more of the error's methods: a panic in them would
// escape the stream reader (Run to its caller; on Start's reader, the
// process).
func TestConverterErrorMethodsRunUnderTheGuard(t *testing.T) {
	conv := ConverterFunc(func(typeurl.Any) (string, any, error) { return "k", nil, &flakyUnwrapErr{} })
	h := newHarness(t, newRecorder(), WithConverter(conv))
	stream := newFakeStream()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	escaped := make(chan any, 1)
	go func() {
		defer func() { escaped <- recover() }()
		_ = h.m.Run(ctx, stream)
	}()
	sub := <-stream.newSub
	sub.send(t, envelope(t, "", wrapperspb.String("c1")))
	waitFor(t, func() bool {
		select {
		case r := <-escaped:
			escaped <- r
			return true
		default:
		}
		return h.m.Stats().Dropped == 1
	}, "the envelope was neither dropped nor did Run end")
	select {
	case r := <-escaped:
		assert.Nil(t, r, "a panic in the converter's error escaped Run")
	default:
		cancel()
		assert.Nil(t, <-escaped)
	}
	assertBalanced(t, h.m.Stats())
}

// printingMetrics prints every HandlerDone, for a child process's output.
type printingMetrics struct{}

func (printingMetrics) HandlerDone(_ time.Duration, err error) { fmt.Printf("HANDLERDONE %v\n", err) }
func (printingMetrics) Recovered(time.Duration)                {}
func (printingMetrics) Dropped(error, int)                     {}

// A log hook's panic on the retry line is the process's (doc.go), and goes
// on unchanged: handle's Goexit path does not settle the call and run the
// report's user code (Metrics, drop handler, log) while the process is
// crashing, where a blocking callback would keep the crash from happening.
func TestARetryLinePanicIsNotSettledAsAGoexit(t *testing.T) {
	if inCrashChild(t) {
		clk := testclock.NewFakeClock(epoch)
		r := newRecorder()
		r.fail(ev{"a", 1}, 1)
		lg, _ := endingLogger("retrying backed-off events", func() { panic("log hook panics") })
		m, err := New(r, WithClock(clk), WithLogger(lg), WithMetrics(printingMetrics{}))
		require.NoError(t, err)
		require.NoError(t, m.Submit("a", ev{"a", 1}))
		require.NoError(t, m.WaitIdle(context.Background()))
		clk.Step(time.Second)
		select {} // the panic ends the process
	}
	out := runCrashChild(t)
	require.Contains(t, out, "panic: log hook panics", "%s", out)
	assert.Equal(t, 1, strings.Count(out, "HANDLERDONE"),
		"only the first call was made and reported; the crashing retry was settled as a Goexit:\n%s", out)
}
