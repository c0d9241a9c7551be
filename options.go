package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"
)

// Option configures a Monitor. Options are applied in order; New validates
// the result and reports every invalid value at once.
type Option func(*config)

type config struct {
	namespace       string
	converter       Converter
	clock           clock.WithTicker
	initialBackoff  time.Duration
	maxBackoff      time.Duration
	jitter          float64
	workers         int
	handleTimeout   time.Duration
	maxOverruns     int
	maxAttempts     int
	maxQueuedPerKey int
	intakeLimit     int
	onDrop          func(Drop)
	resubInitial    time.Duration
	resubMax        time.Duration
	resync          func(ctx context.Context) error
	logger          *log.Entry
	metrics         Metrics
	deferredStart   bool
}

// Defaults. The backoff and worker defaults are containerd's CRI event
// monitor's, so swapping it for this monitor changes no timing by default.
const (
	DefaultInitialBackoff     = time.Second
	DefaultMaxBackoff         = 5 * time.Minute
	DefaultHandleTimeout      = 10 * time.Second
	DefaultResubscribeInitial = 100 * time.Millisecond
	DefaultResubscribeMax     = time.Second
	DefaultIntakeLimit        = 4096
	DefaultMaxOverruns        = 64
)

// MaxWorkers bounds WithWorkers. Each worker is a goroutine and a handler
// call that may be in flight at once; a node never needs more, and a typo
// (1e6) should be an error rather than gigabytes of stacks.
const MaxWorkers = 4096

func defaultConfig() config {
	return config{
		clock:          clock.RealClock{},
		initialBackoff: DefaultInitialBackoff,
		maxBackoff:     DefaultMaxBackoff,
		workers:        1,
		handleTimeout:  DefaultHandleTimeout,
		maxOverruns:    DefaultMaxOverruns,
		intakeLimit:    DefaultIntakeLimit,
		resubInitial:   DefaultResubscribeInitial,
		resubMax:       DefaultResubscribeMax,
		logger:         log.L,
	}
}

// WithNamespace keeps only envelopes of namespace ns; the others are counted
// as Filtered. "" (the default) keeps every namespace.
func WithNamespace(ns string) Option { return func(c *config) { c.namespace = ns } }

// WithConverter sets how envelopes become typed, keyed events. Envelope
// intake (Subscribe, Start, Run) needs one; Submit does not.
func WithConverter(conv Converter) Option { return func(c *config) { c.converter = conv } }

// WithClock sets the clock behind every delay, deadline and timestamp.
// Tests pass a k8s.io/utils/clock/testing.FakeClock.
func WithClock(clk clock.WithTicker) Option { return func(c *config) { c.clock = clk } }

// WithBackoff sets a failed key's first delay and the cap it doubles up to.
func WithBackoff(initial, max time.Duration) Option {
	return func(c *config) { c.initialBackoff, c.maxBackoff = initial, max }
}

// WithJitter spreads every backoff delay uniformly over ±fraction of itself
// (0..1), so keys that failed together do not all retry together.
func WithJitter(fraction float64) Option { return func(c *config) { c.jitter = fraction } }

// WithWorkers sets how many keys are handled at once. The default, 1, is
// serial as in containerd.
func WithWorkers(n int) Option { return func(c *config) { c.workers = n } }

// WithHandleTimeout sets the deadline of every handler call's context, the
// call's start on the monitor's clock plus d (default DefaultHandleTimeout).
// A call still running a grace of min(1 s, d/10) past it overruns (a handler
// ignoring its ctx, say a hung shim call): it is logged and keeps its key
// held until it really returns, but a new worker takes its place (see
// WithMaxOverruns), and Stop abandons it. 0 sets no deadline, for handlers
// that enforce their own: nothing overruns, and Stop waits for every call.
func WithHandleTimeout(d time.Duration) Option { return func(c *config) { c.handleTimeout = d } }

// WithMaxOverruns bounds how many overrunning calls may have their worker
// replaced at once (default DefaultMaxOverruns): each costs a goroutine
// until it returns. Past it, an overrunning call keeps its worker (logged at
// error level). 0 never replaces a worker.
func WithMaxOverruns(n int) Option { return func(c *config) { c.maxOverruns = n } }

// WithMaxAttempts gives up on an event after n failed handler calls and hands
// it to the drop handler with ErrMaxAttempts. 0 (the default) retries forever.
func WithMaxAttempts(n int) Option { return func(c *config) { c.maxAttempts = n } }

// WithMaxQueuedPerKey bounds how many events one key may hold waiting. Beyond
// it, Submit returns ErrQueueFull and stream intake drops with ErrQueueFull.
// 0 (the default) is unbounded.
func WithMaxQueuedPerKey(n int) Option { return func(c *config) { c.maxQueuedPerKey = n } }

// WithIntakeLimit sets the backpressure bound of stream intake: while n
// accepted events wait for a worker, the monitor stops reading its stream, so
// a flood is held by the runtime, not in our memory. Submit is never blocked.
func WithIntakeLimit(n int) Option { return func(c *config) { c.intakeLimit = n } }

// WithDropHandler receives every event the monitor gives up on, with the
// reason. It is called without locks held, possibly from several goroutines
// at once. The default logs the drop.
func WithDropHandler(fn func(Drop)) Option { return func(c *config) { c.onDrop = fn } }

// WithResubscribe sets Run's reconnect backoff: initial delay, doubling to
// max. The default cap is a second: a local runtime's socket costs nothing
// to retry, and a longer cap mostly delays the return after a restart.
func WithResubscribe(initial, max time.Duration) Option {
	return func(c *config) { c.resubInitial, c.resubMax = initial, max }
}

// WithResync sets a hook that Run calls once per outage, so the embedding
// runtime can relist what the broken stream missed. After the stream broke,
// Run re-subscribes until a subscription is established (it delivered an
// event, or was not refused within the initial resubscribe delay) and then
// calls fn, with a context that ends with that subscription, beside the
// reading of it. Attempts refused while the runtime is down call nothing.
//
// A window remains: the runtime may register the new subscriber a little
// after accepting it (containerd: a few milliseconds), and an event published
// in between reaches neither the stream nor, if the change is undone before
// fn lists, the resync. A periodic relist (relist.Relister.Run) closes it.
func WithResync(fn func(ctx context.Context) error) Option {
	return func(c *config) { c.resync = fn }
}

// WithDeferredStart makes New's monitor hold everything it accepts until
// Start, Run or Shutdown is called, as containerd's monitor does: Submit,
// Backoff and WatchExit queue their events, but nothing is handled and no
// backoff replays. A key whose backoff came due while held replays at once
// when the hold ends. Use it when events may arrive (a recovery calling
// Backoff, say) before their handler can run.
func WithDeferredStart() Option { return func(c *config) { c.deferredStart = true } }

// WithLogger sets the logger; every line carries the event's fields on top.
func WithLogger(l *log.Entry) Option { return func(c *config) { c.logger = l } }

func (c *config) validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOption}, args...)...))
	}
	if c.clock == nil {
		bad("nil clock")
	}
	if c.initialBackoff <= 0 || c.maxBackoff <= 0 || c.initialBackoff > c.maxBackoff {
		bad("backoff initial %v, max %v: want 0 < initial <= max", c.initialBackoff, c.maxBackoff)
	}
	if !(c.jitter >= 0 && c.jitter <= 1) { // also rejects NaN
		bad("jitter %v: want 0..1", c.jitter)
	}
	if c.workers < 1 || c.workers > MaxWorkers {
		bad("workers %d: want 1..%d", c.workers, MaxWorkers)
	}
	if c.handleTimeout < 0 {
		bad("handle timeout %v: want > 0, or 0 for none", c.handleTimeout)
	}
	if c.maxOverruns < 0 {
		bad("max overruns %d: want >= 0", c.maxOverruns)
	}
	if c.maxAttempts < 0 {
		bad("max attempts %d: want >= 0", c.maxAttempts)
	}
	if c.maxQueuedPerKey < 0 {
		bad("max queued per key %d: want >= 0", c.maxQueuedPerKey)
	}
	if c.intakeLimit < 1 {
		bad("intake limit %d: want at least 1", c.intakeLimit)
	}
	if c.resubInitial <= 0 || c.resubMax <= 0 || c.resubInitial > c.resubMax {
		bad("resubscribe initial %v, max %v: want 0 < initial <= max", c.resubInitial, c.resubMax)
	}
	if c.converter != nil && isNil(c.converter) {
		bad("nil converter (%T)", c.converter)
	}
	if c.logger == nil {
		bad("nil logger")
	}
	return errors.Join(errs...)
}
