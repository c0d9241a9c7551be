package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"
)

// Option configures a Monitor. Options apply in order; New validates the
// result and reports every invalid value at once.
type Option func(*config)

type config struct {
	namespace                  string
	converter                  Converter
	clock                      clock.WithTicker
	initialBackoff, maxBackoff time.Duration
	jitter                     float64
	workers                    int
	handleTimeout              time.Duration
	maxOverruns                int
	maxAttempts                int
	maxQueuedPerKey            int
	intakeLimit                int
	onDrop                     func(Drop)
	resubInitial, resubMax     time.Duration
	resync                     func(ctx context.Context) error
	logger                     *log.Entry
	metrics                    Metrics
	deferredStart              bool
}

// Defaults. Backoff and workers match containerd's CRI event monitor, so
// replacing it changes no timing.
const (
	DefaultInitialBackoff     = time.Second
	DefaultMaxBackoff         = 5 * time.Minute
	DefaultHandleTimeout      = 10 * time.Second
	DefaultResubscribeInitial = 100 * time.Millisecond
	DefaultResubscribeMax     = time.Second
	DefaultIntakeLimit        = 4096
	DefaultMaxOverruns        = 64
)

// defaultConfig is New's starting point, before the options: the Default
// values above.
func defaultConfig() config {
	return config{clock: clock.RealClock{}, initialBackoff: DefaultInitialBackoff, maxBackoff: DefaultMaxBackoff,
		workers: 1, handleTimeout: DefaultHandleTimeout, maxOverruns: DefaultMaxOverruns, intakeLimit: DefaultIntakeLimit,
		resubInitial: DefaultResubscribeInitial, resubMax: DefaultResubscribeMax, logger: log.L}
}

// MaxWorkers bounds WithWorkers: each worker is a goroutine with a handler
// call in flight, and a typo (1e6) should be an error, not gigabytes of stacks.
const MaxWorkers = 4096

// WithNamespace keeps only envelopes of namespace ns, counting others as
// Filtered. "" (the default) keeps all.
func WithNamespace(ns string) Option { return func(c *config) { c.namespace = ns } }

// WithConverter sets how envelopes become keyed events, as Subscribe, Start
// and Run need (Submit does not). It runs on the stream reader's goroutine,
// which Stop, Shutdown and WaitIdle may wait for: it must not call them.
func WithConverter(conv Converter) Option { return func(c *config) { c.converter = conv } }

// WithClock sets the clock for all delays, deadlines and timestamps. A
// handler's ctx.Deadline is on this clock, and code under the handler that
// measures it by the real time (net.Dialer, gRPC) takes it as real time
// (see package eventmonitortest).
func WithClock(clk clock.WithTicker) Option { return func(c *config) { c.clock = clk } }

// WithBackoff sets a failed key's first delay and the cap it doubles up to.
func WithBackoff(initial, max time.Duration) Option {
	return func(c *config) { c.initialBackoff, c.maxBackoff = initial, max }
}

// WithJitter spreads each backoff delay uniformly over ±fraction (0..1) of
// itself, so keys that failed together do not retry together. The spread
// comes from math/rand/v2's unseeded source: a test that steps a fake
// clock to exact retry times leaves jitter off (the default) or steps to
// NextRetry. A delay at WithBackoff's cap is spread too, so a wait may
// pass the cap by up to the fraction.
func WithJitter(fraction float64) Option { return func(c *config) { c.jitter = fraction } }

// WithWorkers sets how many keys are handled at once (1..MaxWorkers). The
// default, 1, is serial as in containerd, but for exits: WatchExit handles
// an exit on an idle key in its own goroutine, beside the workers, as
// containerd's exit monitors do.
func WithWorkers(n int) Option { return func(c *config) { c.workers = n } }

// WithHandleTimeout sets each handler call's ctx deadline to d after the
// call starts, which is when a worker takes its event (a replay's log line,
// written first, counts against it); default DefaultHandleTimeout. A call
// running min(1s, d/10) past it overruns: it is logged and holds its key
// until it returns, but a new worker replaces it (see WithMaxOverruns) and
// Stop abandons it. 0 sets no deadline, for handlers with their own:
// nothing overruns, Stop waits.
func WithHandleTimeout(d time.Duration) Option { return func(c *config) { c.handleTimeout = d } }

// WithMaxOverruns bounds how many overrunning calls (each a goroutine until it
// returns) get a replacement worker at once; default DefaultMaxOverruns. Past
// it, a call keeps its worker until a replaced call returns, and an error
// is logged. 0 never replaces one; each overrun is then only a warning, as
// keeping the worker is the setting.
func WithMaxOverruns(n int) Option { return func(c *config) { c.maxOverruns = n } }

// WithMaxAttempts drops an event with ErrMaxAttempts after n failed handler
// calls. 0 (the default) retries forever.
func WithMaxAttempts(n int) Option { return func(c *config) { c.maxAttempts = n } }

// WithMaxQueuedPerKey bounds the events one key may hold waiting: beyond it,
// Submit and stream intake fail with ErrQueueFull. 0 (the default) is none.
func WithMaxQueuedPerKey(n int) Option { return func(c *config) { c.maxQueuedPerKey = n } }

// WithIntakeLimit (>= 1) pauses stream reading while n accepted events wait
// for a worker (Stats.Queued, those behind a running call of their key
// too), so a flood waits in the runtime, not in memory. Events of keys in
// backoff do not count: they wait for their due time, and counting them
// would let failing keys stop the stream for all others.
// WithMaxQueuedPerKey bounds one key's share, in backoff or not. Submit
// never blocks.
func WithIntakeLimit(n int) Option { return func(c *config) { c.intakeLimit = n } }

// WithDropHandler receives every event given up on, with the reason, without
// locks held and possibly concurrently; Stop, Shutdown and WaitIdle may be
// waiting for it, so it must not call them but in a goroutine. A panic in
// it is logged. A runtime.Goexit in it (t.FailNow) ends the goroutine: the
// Drops that goroutine had yet to hand over are lost (Stats still counts
// them), and on Start's stream reader reading ends, reported on Start's
// channel. The default logs the drop.
func WithDropHandler(fn func(Drop)) Option { return func(c *config) { c.onDrop = fn } }

// WithResubscribe sets Run's reconnect delay, doubling from initial to max.
// The default cap is a second: a local socket is free to retry, and a longer
// cap mostly delays recovery after a runtime restart.
func WithResubscribe(initial, max time.Duration) Option {
	return func(c *config) { c.resubInitial, c.resubMax = initial, max }
}

// WithResync sets fn, which Run calls once per outage so that the runtime
// can relist what the stream missed. An outage is a broken stream, or the
// time since an earlier Run or Start stopped reading. fn runs beside the
// reading of the new subscription once it is established (it delivered an
// event, or was not refused within the initial resubscribe delay, so a
// Subscriber should report a refusal at once), with a ctx that ends with
// it; Run waits for fn, so fn must heed ctx. An error fn returns is
// logged, not retried. A window remains: containerd registers a subscriber
// milliseconds after accepting it, and an event published then is missed
// (by fn too, if fn listed before that change); periodic
// relist.Relister.Run closes it, and covers what a failed fn missed.
func WithResync(fn func(ctx context.Context) error) Option {
	return func(c *config) { c.resync = fn }
}

// WithDeferredStart holds everything accepted (Submit, Backoff, WatchExit)
// unhandled until Start or Run begins (one refused, say for want of a
// converter, holds on) or Shutdown, as containerd does; backoffs due
// meanwhile replay at once. Use it when events may precede their handler.
func WithDeferredStart() Option { return func(c *config) { c.deferredStart = true } }

// WithMetrics sets where the monitor reports durations and drops.
func WithMetrics(m Metrics) Option { return func(c *config) { c.metrics = m } }

// WithLogger sets the logger; each line also carries the event's fields.
func WithLogger(l *log.Entry) Option { return func(c *config) { c.logger = l } }

func (c *config) validate() error {
	var errs []error
	check := func(bad bool, format string, args ...any) {
		if bad {
			errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOption}, args...)...))
		}
	}
	check(isNil(c.clock), "WithClock: nil clock (%T)", c.clock)
	check(c.initialBackoff <= 0 || c.maxBackoff <= 0 || c.initialBackoff > c.maxBackoff,
		"WithBackoff(%v, %v): want 0 < initial <= max", c.initialBackoff, c.maxBackoff)
	check(!(c.jitter >= 0 && c.jitter <= 1), "WithJitter(%v): want 0..1", c.jitter) // also rejects NaN
	check(c.workers < 1 || c.workers > MaxWorkers, "WithWorkers(%d): want 1..%d", c.workers, MaxWorkers)
	check(c.handleTimeout < 0, "WithHandleTimeout(%v): want > 0, or 0 for none", c.handleTimeout)
	check(c.maxOverruns < 0, "WithMaxOverruns(%d): want >= 0", c.maxOverruns)
	check(c.maxAttempts < 0, "WithMaxAttempts(%d): want >= 0, 0 for no limit", c.maxAttempts)
	check(c.maxQueuedPerKey < 0, "WithMaxQueuedPerKey(%d): want >= 0, 0 for no limit", c.maxQueuedPerKey)
	check(c.intakeLimit < 1, "WithIntakeLimit(%d): want at least 1", c.intakeLimit)
	check(c.resubInitial <= 0 || c.resubMax <= 0 || c.resubInitial > c.resubMax,
		"WithResubscribe(%v, %v): want 0 < initial <= max", c.resubInitial, c.resubMax)
	check(c.converter != nil && isNil(c.converter), "WithConverter: nil converter (%T); leave the option out for none", c.converter)
	check(c.metrics != nil && isNil(c.metrics), "WithMetrics: nil metrics (%T); leave the option out for none", c.metrics)
	check(c.logger == nil, "WithLogger: nil logger; leave the option out for the default")
	return errors.Join(errs...)
}
