package eventmonitor

import (
	"errors"
	"fmt"
)

// User code runs under a guard, so that it cannot take a worker, a watcher
// or the stream reader down:
//   - the handler: invoke, where a panic fails the call;
//   - the converter, resync hook, exit status and exit builder:
//     errOnPanic, which makes a panic their error;
//   - the drop handler, Metrics and an ignored payload's GetTypeUrl:
//     logOnPanic;
//   - what they return: checked, for an error whose Error panics, and
//     panicked, for a panic's value whose Error panics;
//   - a panic(nil), which recover sees as nil under GODEBUG=panicnil=1:
//     recovering (and invoke, with its own flag) tells it by fn not
//     returning;
//   - runtime.Goexit (t.FailNow in a test's callback), which no recover
//     stops: onGoexit around a worker's retry line, handler call and
//     report, so that the call still settles and its slot goes on;
//     around an envelope's conversion and an exit's reading, so that what
//     was taken in is dropped; and around Start's reading, which then
//     reports it. Counts released in defers (accepting, watchers) are
//     released still. Nothing hangs, but what the ended goroutine had left
//     to report (a drop, a log line) is lost.
//
// A Subscriber runs on the caller's goroutine (Subscribe, Run), so its
// panic is the caller's.

// checked returns err, from user code (a handler, converter, subscriber,
// hook or exit status), or an error saying so if err's Error panics (say,
// a typed nil pointer): a logger calls Error with no recover waiting.
// errors.Is runs the error's own methods too (*net.OpError's Unwrap panics
// on nil): callers run it under a recover.
func checked(err error) error {
	if err == nil {
		return nil
	}
	if r, ok := recovering(func() { _ = err.Error() }); !ok {
		return fmt.Errorf("a %T whose Error panics: %s", err, panicked(r))
	}
	return err
}

// recovering runs fn, which calls user code, and recovers a panic: ok is
// whether fn returned, r the panic's value if not. That fn did not return
// tells a panic(nil) too, which recover returns as nil under
// GODEBUG=panicnil=1. A runtime.Goexit goes on through, even if a panic
// raised after it began is recovered here: recovering never returns from
// one (see onGoexit).
func recovering(fn func()) (r any, ok bool) {
	func() {
		defer func() { r = recover() }()
		fn()
		ok = true
	}()
	return r, ok
}

// panicked formats r, a recovered panic's value. It calls r's Error or
// String itself, under recovering: fmt prints nothing for one that panics
// with nil under panicnil, and panics itself if that panic's value panics
// too. If they panic, it names r's type and adds what fmt.Sprint manages.
func panicked(r any) (s string) {
	format := func() { s = fmt.Sprint(r) }
	switch v := r.(type) {
	case error:
		format = func() { s = v.Error() }
	case fmt.Stringer:
		format = func() { s = v.String() }
	}
	if _, ok := recovering(format); ok {
		return s
	}
	s = fmt.Sprintf("a %T whose Error or String panics", r)
	var printed string
	if _, ok := recovering(func() { printed = fmt.Sprint(r) }); ok && printed != "" {
		s += ": " + printed
	}
	return s
}

// onGoexit runs fn, which calls user code. If fn ends the goroutine
// (runtime.Goexit), rest runs as it unwinds, to finish what fn left. A
// panic goes on unchanged and skips rest; so does a panic raised during a
// Goexit and recovered above (only Run's caller can recover one).
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
	// Back here without fn returning: recover, which stops no Goexit,
	// stopped a panic(nil) it returned as nil (GODEBUG=panicnil=1).
	if !returned {
		panicking = true
		panic(nil)
	}
}

// errOnPanic runs fn, which calls user code, and returns its error or, if
// it panicked, one wrapping wrap and the panic's value.
func errOnPanic(wrap error, fn func() error) (err error) {
	if r, ok := recovering(func() { err = fn() }); !ok {
		return fmt.Errorf("%w: %s", wrap, panicked(r))
	}
	return err
}

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
	// oversized key, a converter or exit builder that panicked, user code
	// that ended the goroutine converting an envelope or reading or
	// building an exit, or a converter's error wrapping it.
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
	// (runtime.Goexit); the event counts as failed.
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
