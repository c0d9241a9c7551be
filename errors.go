package eventmonitor

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error the monitor makes, returned or in a Drop,
// wraps one of these; test with errors.Is. Errors it passes on keep their
// own: a ctx's (WaitIdle's as it is, Shutdown's wrapped), a stream's (on
// Start's channel), and a handler's (in the Drop of an event given up on,
// beside the sentinel).
var (
	// ErrUnsupportedEvent: a type URL unknown to typeurl or a type with no
	// TypeKey; not the monitor's to handle, so Stats.Ignored, not a drop.
	ErrUnsupportedEvent = errors.New("eventmonitor: unsupported event type")
	// ErrInvalidEvent: a nil envelope, payload or event, an empty or
	// oversized key, a converter or exit builder that panicked, or a
	// converter's error wrapping it.
	ErrInvalidEvent = errors.New("eventmonitor: invalid event")
	// ErrDecode: the payload's bytes could not be unmarshalled, or a
	// converter failed on them with an error of its own (wrapped).
	ErrDecode = errors.New("eventmonitor: cannot decode event")
	// ErrMaxAttempts: the event failed as many times as WithMaxAttempts allows.
	ErrMaxAttempts = errors.New("eventmonitor: gave up after max attempts")
	// ErrQueueFull: the key already holds WithMaxQueuedPerKey events.
	ErrQueueFull = errors.New("eventmonitor: key queue full")
	// ErrStopped: the monitor is stopped or shutting down.
	ErrStopped = errors.New("eventmonitor: monitor stopped")
	// ErrHandlerPanic: the handler panicked or ended its goroutine
	// (runtime.Goexit), or a log hook did on a replay's retry line; the
	// event counts as failed.
	ErrHandlerPanic = errors.New("eventmonitor: handler panicked")
	// ErrInvalidOption: New was given an unusable option value or a nil
	// handler, or Run a nil Subscriber.
	ErrInvalidOption = errors.New("eventmonitor: invalid option")
	// ErrNoConverter: envelope intake needs WithConverter.
	ErrNoConverter = errors.New("eventmonitor: no converter (use WithConverter)")
	// ErrAlreadyRunning: a Run or Start is already reading; one stream is
	// read at a time, so that no event is handled twice.
	ErrAlreadyRunning = errors.New("eventmonitor: a stream is already being read (one Run or Start at a time)")
	// ErrStreamClosed: the subscriber closed its stream without an error.
	ErrStreamClosed = errors.New("eventmonitor: event stream closed")
)

// User code runs under a recover, so that its panic costs only what it was
// given:
//   - the handler's fails its event (invoke);
//   - the converter's, exit status's, exit builder's and resync hook's
//     become their error (errOnPanic);
//   - the drop handler's and Metrics' are logged (logOnPanic);
//   - an ignored payload's GetTypeUrl's leaves the type out of the log line.
//
// Log hooks are not guarded: their panic is the process's. Errors from user
// code pass through checked before anything logs them, and errors.Is, which
// runs an error's own methods, runs under the same recover as the code that
// returned it.
//
// A handler ending its goroutine (runtime.Goexit, as t.FailNow does) fails
// its event. Other callbacks should not; where one does, the goroutine's
// bookkeeping is deferred (onGoexit, or a defer) so that no key, slot or
// place stays held (see doc.go), and what it had left to do is not done.

// recovering runs fn and recovers its panic: ok reports whether fn
// returned, which also tells a panic(nil) under GODEBUG=panicnil=1. A
// runtime.Goexit goes on through, even if a panic raised after the Goexit
// began is recovered here: recovering never returns from one.
func recovering(fn func()) (r any, ok bool) {
	defer func() {
		if !ok {
			r = recover()
		}
	}()
	fn()
	return nil, true
}

// onGoexit runs fn, which calls user code. If fn ends the goroutine
// (runtime.Goexit), rest runs as it unwinds, to release what the goroutine
// holds. A panic goes on unchanged and skips rest; so does a panic(nil)
// that recover stopped (GODEBUG=panicnil=1), raised again.
func onGoexit(fn, rest func()) {
	returned, panicking := false, false
	defer func() {
		if !returned && !panicking {
			rest()
		}
	}()
	func() {
		defer func() {
			if r := recover(); r != nil {
				panicking = true
				panic(r) // its frames are still on the stack
			}
		}()
		fn()
		returned = true
	}()
	if !returned { // back here without fn returning: recover stopped a panic(nil)
		panicking = true
		panic(nil)
	}
}

// errOnPanic returns fn's error or, if fn panicked, one wrapping wrap.
func errOnPanic(wrap error, fn func() error) (err error) {
	if r, ok := recovering(func() { err = fn() }); !ok {
		return fmt.Errorf("%w: %s", wrap, panicked(r))
	}
	return err
}

// checked returns err, or an error saying so if err's Error panics (a typed
// nil pointer, say), which a log line would otherwise crash on.
func checked(err error) error {
	if err == nil {
		return nil
	}
	if r, ok := recovering(func() { _ = err.Error() }); !ok {
		return fmt.Errorf("a %T whose Error panics: %s", err, panicked(r))
	}
	return err
}

// panicked formats a recovered panic's value, even one whose own Error or
// String panics (fmt recovers that, but not a panic of the panic's value).
func panicked(r any) (s string) {
	if _, ok := recovering(func() { s = fmt.Sprint(r) }); !ok {
		return fmt.Sprintf("a %T that cannot be printed", r)
	}
	return s
}
