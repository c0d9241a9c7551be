package eventmonitor

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"
)

// Option configures a Monitor. New validates the options together.
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

// defaultConfig holds the defaults each option's doc states; backoff and
// workers are containerd's CRI event monitor's, so replacing it changes no
// timing.
func defaultConfig() config {
	return config{clock: clock.RealClock{}, initialBackoff: time.Second, maxBackoff: 5 * time.Minute,
		workers: 1, handleTimeout: 10 * time.Second, maxOverruns: 64, intakeLimit: 4096,
		resubInitial: 100 * time.Millisecond, resubMax: time.Second, logger: log.L}
}

// maxWorkers bounds WithWorkers, so that a typo is an error, not gigabytes of stacks.
const maxWorkers = 4096

// WithNamespace keeps only envelopes of namespace ns, counting others as
// Filtered. "" (the default) keeps all.
func WithNamespace(ns string) Option { return func(c *config) { c.namespace = ns } }

// WithConverter sets how envelopes become keyed events, which Subscribe,
// Start and Run need (Submit does not).
func WithConverter(conv Converter) Option { return func(c *config) { c.converter = conv } }

// WithClock sets the clock for every delay, deadline and timestamp; default
// the real one. Tests pass a k8s.io/utils/clock/testing.FakeClock.
func WithClock(clk clock.WithTicker) Option { return func(c *config) { c.clock = clk } }

// WithBackoff sets a failed event's first delay and the cap it doubles up
// to with each failure; default 1 s and 5 min.
func WithBackoff(initial, max time.Duration) Option {
	return func(c *config) { c.initialBackoff, c.maxBackoff = initial, max }
}

// WithJitter spreads each backoff delay uniformly over ±fraction (0..1) of
// itself, so that keys that failed together do not retry together; default 0.
func WithJitter(fraction float64) Option { return func(c *config) { c.jitter = fraction } }

// WithWorkers sets how many keys are handled at once (1..4096); default 1,
// serial as in containerd.
func WithWorkers(n int) Option { return func(c *config) { c.workers = n } }

// WithHandleTimeout sets each handler call's deadline, d after it starts;
// default 10 s. A call still running min(1 s, d/10) later overruns: it is
// logged and keeps its key until it returns. 0 sets no deadline.
func WithHandleTimeout(d time.Duration) Option { return func(c *config) { c.handleTimeout = d } }

// WithMaxOverruns bounds how many overrunning calls give their worker to a
// new one at once (each is a goroutine until it returns); default 64.
func WithMaxOverruns(n int) Option { return func(c *config) { c.maxOverruns = n } }

// WithMaxAttempts drops an event with ErrMaxAttempts after n failed handler
// calls (an event given to Backoff has used one); default 0, retry forever.
func WithMaxAttempts(n int) Option { return func(c *config) { c.maxAttempts = n } }

// WithMaxQueuedPerKey bounds the events one key may hold, its call's
// included; beyond it Submit, Backoff and envelopes fail with ErrQueueFull
// (exits never do). Default 0, no bound.
func WithMaxQueuedPerKey(n int) Option { return func(c *config) { c.maxQueuedPerKey = n } }

// WithIntakeLimit pauses stream reading while n events wait for a worker
// (events in backoff do not count), so that a flood waits in the runtime,
// not in memory; default 4096.
func WithIntakeLimit(n int) Option { return func(c *config) { c.intakeLimit = n } }

// WithDropHandler receives every event the monitor gives up on, with the
// reason, possibly concurrently; the default logs it.
func WithDropHandler(fn func(Drop)) Option { return func(c *config) { c.onDrop = fn } }

// WithResubscribe sets Run's reconnect delay, doubling from initial to max;
// default 100 ms and 1 s.
func WithResubscribe(initial, max time.Duration) Option {
	return func(c *config) { c.resubInitial, c.resubMax = initial, max }
}

// WithResync sets fn, which Run calls once each subscription is established,
// the first included, so that the caller can list what the stream missed.
// fn runs beside the reading with a ctx that ends with the subscription.
func WithResync(fn func(ctx context.Context) error) Option {
	return func(c *config) { c.resync = fn }
}

// WithDeferredStart holds everything accepted unhandled until Start, Run or
// Shutdown, as containerd's monitor handles nothing before Start.
func WithDeferredStart() Option { return func(c *config) { c.deferredStart = true } }

// WithMetrics sets where the monitor reports durations and drops.
func WithMetrics(m Metrics) Option { return func(c *config) { c.metrics = m } }

// WithLogger sets the logger; default log.L.
func WithLogger(l *log.Entry) Option { return func(c *config) { c.logger = l } }

func (c *config) validate() error {
	var errs []error
	check := func(bad bool, format string, args ...any) {
		if bad {
			errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidOption}, args...)...))
		}
	}
	check(isNil(c.clock), "WithClock: nil clock (%T)", c.clock)
	check(c.initialBackoff <= 0 || c.initialBackoff > c.maxBackoff,
		"WithBackoff(%v, %v): want 0 < initial <= max", c.initialBackoff, c.maxBackoff)
	check(!(c.jitter >= 0 && c.jitter <= 1), "WithJitter(%v): want 0..1", c.jitter) // also refuses NaN
	check(c.workers < 1 || c.workers > maxWorkers, "WithWorkers(%d): want 1..%d", c.workers, maxWorkers)
	check(c.handleTimeout < 0, "WithHandleTimeout(%v): want > 0, or 0 for none", c.handleTimeout)
	check(c.maxOverruns < 0, "WithMaxOverruns(%d): want >= 0", c.maxOverruns)
	check(c.maxAttempts < 0, "WithMaxAttempts(%d): want >= 0, 0 for no limit", c.maxAttempts)
	check(c.maxQueuedPerKey < 0, "WithMaxQueuedPerKey(%d): want >= 0, 0 for no limit", c.maxQueuedPerKey)
	check(c.intakeLimit < 1, "WithIntakeLimit(%d): want at least 1", c.intakeLimit)
	check(c.resubInitial <= 0 || c.resubInitial > c.resubMax,
		"WithResubscribe(%v, %v): want 0 < initial <= max", c.resubInitial, c.resubMax)
	check(c.converter != nil && isNil(c.converter), "WithConverter: nil converter (%T)", c.converter)
	check(c.metrics != nil && isNil(c.metrics), "WithMetrics: nil metrics (%T)", c.metrics)
	check(c.logger == nil, "WithLogger: nil logger")
	return errors.Join(errs...)
}
