package eventmonitor

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/containerd/log"
)

// Monitor handles typed events in order per key, with parallelism across
// keys and per-key exponential backoff. Create it with New; release it with
// Stop or Shutdown.
type Monitor struct {
	cfg     config
	handler Handler
	base    context.Context // parent of every handler's ctx: carries the logger

	// mu guards what follows, up to intake; every change ends in changed,
	// which starts what can start and wakes whoever waits on cond.
	mu             sync.Mutex
	cond           sync.Cond
	state          lifecycle
	keys           *keySet
	calls          []*call // in progress, in start order
	handing        int     // refused events whose drop is being handed over
	abandonedDrops []Drop  // Stop's drops of abandoned calls, for finishStop
	stats          Stats   // the counters; Stats derives the gauges
	sched          scheduler
	stream         streamState

	intake    context.Context // ends when Shutdown or Stop is called
	endIntake context.CancelFunc
	stopping  chan struct{} // closed as Stop begins, for exit watchers
	lifetime  chan error    // a bare Start's channel, closed when Stop is done
	// work is what Stop waits for: the scheduler, stream readers, exit
	// watchers while they wait, and calls until released, or abandoned.
	work     sync.WaitGroup
	stopOnce sync.Once

	ignoredTypes, filteredNamespaces logOnce[string]
}

// lifecycle is the monitor's state; it only moves forward.
type lifecycle uint8

const (
	held     lifecycle = iota // WithDeferredStart: accepts, handles nothing, retries nothing
	running                   // accepts and handles
	draining                  // Shutdown: accepts only what the stream reader still holds, handles everything
	stopped                   // Stop began: accepts nothing, starts no call
)

// New returns a Monitor that hands events to h. It starts no goroutine until
// there is something to do. Invalid options are reported together, wrapping
// ErrInvalidOption.
func New(h Handler, opts ...Option) (*Monitor, error) {
	if isNil(h) {
		return nil, fmt.Errorf("%w: nil handler (%T)", ErrInvalidOption, h)
	}
	cfg := defaultConfig()
	for _, opt := range opts {
		if opt != nil {
			opt(&cfg)
		}
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := checkRoutes(h, cfg.converter); err != nil {
		return nil, err
	}
	if cfg.onDrop == nil {
		cfg.onDrop = logDrop(cfg.logger)
	}
	m := &Monitor{
		cfg:      cfg,
		handler:  h,
		base:     log.WithLogger(context.Background(), cfg.logger),
		keys:     newKeySet(backoffPolicy{cfg.initialBackoff, cfg.maxBackoff, cfg.jitter}, cfg.maxQueuedPerKey),
		stopping: make(chan struct{}),
		lifetime: make(chan error),
	}
	if !cfg.deferredStart {
		m.state = running
	}
	m.cond.L = &m.mu
	m.intake, m.endIntake = context.WithCancel(context.Background())
	return m, nil
}

// MustNew is New for options known to be valid, such as constants: it
// panics on an error.
func MustNew(h Handler, opts ...Option) *Monitor {
	m, err := New(h, opts...)
	if err != nil {
		panic(err)
	}
	return m
}

// source is how an event reached the monitor.
type source uint8

const (
	fromSubmit  source = iota // Submit
	fromBackoff               // Backoff: straight into its key's backoff
	fromStream                // an envelope the stream reader took
	fromExit                  // WatchExit: never refused for WithMaxQueuedPerKey
)

// Submit hands the monitor an event that did not come from its stream (a
// relist, an exit). It returns ErrStopped once Shutdown or Stop was
// called, ErrQueueFull, or ErrInvalidEvent; then the event stays the
// caller's.
func (m *Monitor) Submit(key string, event any) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.accept(key, item{event: event}, fromSubmit); err != nil {
		return err
	}
	m.changed()
	return nil
}

// Backoff puts event into key's backoff queue as one failed attempt: the key
// waits the initial delay, if it is not waiting already (once its call in
// progress ends, if it has one). An event the monitor cannot take goes to
// the drop handler.
func (m *Monitor) Backoff(key string, event any) {
	m.mu.Lock()
	it := item{event: event, failed: &failure{attempts: 1, first: m.cfg.clock.Now()}}
	var drops []Drop
	if err := m.accept(key, it, fromBackoff); err != nil {
		drops = m.refuse(key, it, err)
	}
	m.changed()
	m.mu.Unlock()
	m.handOver(drops)
}

// accept validates an event and queues it. mu is held.
func (m *Monitor) accept(name string, it item, from source) error {
	switch {
	case m.state == stopped, from != fromStream && m.intakeEnded():
		return ErrStopped
	case name == "":
		return fmt.Errorf("%w: empty key", ErrInvalidEvent)
	case it.event == nil:
		return fmt.Errorf("%w: nil event for key %q", ErrInvalidEvent, name)
	case from != fromExit && m.keys.full(name):
		return fmt.Errorf("%w: key %q holds WithMaxQueuedPerKey(%d) events", ErrQueueFull, name, m.cfg.maxQueuedPerKey)
	case m.cfg.maxAttempts > 0 && it.attempts() >= m.cfg.maxAttempts: // WithMaxAttempts(1) and Backoff
		return fmt.Errorf("%w (%d)", ErrMaxAttempts, it.attempts())
	}
	m.stats.Received++
	if from == fromBackoff {
		m.keys.pushBackoff(name, it, it.failed.first)
	} else {
		m.keys.push(name, it)
	}
	return nil
}

// InBackoff reports whether key is waiting for a retry, or will once its
// call in progress ends (Backoff during the call).
func (m *Monitor) InBackoff(key string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keys.byName[key]
	return k != nil && !k.due.IsZero()
}

// Forget removes and returns, in order, every event of key not yet started,
// for when the object behind key is gone. A call in progress goes on; if it
// fails, its event backs off as usual.
func (m *Monitor) Forget(key string) []any {
	m.mu.Lock()
	defer m.mu.Unlock()
	var events []any
	for _, it := range m.keys.forget(key) {
		events = append(events, it.event)
	}
	m.stats.Forgotten += uint64(len(events))
	m.changed()
	return events
}

// intakeEnded reports whether Shutdown or Stop was called.
func (m *Monitor) intakeEnded() bool { return m.intake.Err() != nil }

// releaseHold ends WithDeferredStart's hold. mu is held.
func (m *Monitor) releaseHold() {
	if m.state == held {
		m.state = running
		m.changed() // backoffs that came due meanwhile retry now
	}
}

// changed runs after every change, under mu: a draining monitor retries
// every key in backoff at once, free worker slots take ready keys, the
// scheduler's timer follows what is due, and whoever waits on cond looks
// again.
func (m *Monitor) changed() {
	if m.state == draining {
		m.keys.retryDue(time.Time{}, true)
	}
	for m.keys.anyReady() && m.slotsHeld() < m.cfg.workers {
		c := m.takeReady(nil)
		if c == nil {
			break
		}
		go m.serve(c)
	}
	m.retime()
	m.cond.Broadcast()
}
