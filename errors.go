package eventmonitor

import "errors"

// Sentinel errors; test with errors.Is. A Drop's Reason, and every error the
// monitor returns, wraps one of them or a ctx's error.
var (
	// ErrUnsupportedEvent: a type URL unknown to typeurl, a type with no
	// TypeKey, or one a Mux has no route for: ignored, not dropped.
	ErrUnsupportedEvent = errors.New("eventmonitor: unsupported event type")
	// ErrInvalidEvent: a nil envelope, payload or event, an empty key, or a
	// converter or exit builder that panicked.
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
	// ErrInvalidOption: an unusable option, a nil handler, or a stream read
	// without WithConverter.
	ErrInvalidOption = errors.New("eventmonitor: invalid option")
	// ErrAlreadyRunning: a Run or Start is already reading a stream.
	ErrAlreadyRunning = errors.New("eventmonitor: a stream is already being read (one Run or Start at a time)")
)
