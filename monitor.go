package eventmonitor

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/containerd/log"

	"github.com/eventmonitor/eventmonitor/internal/keyq"
)

// MaxKeyLength bounds a key's length in bytes. Container, sandbox and image
// names are far shorter; a longer key is refused as ErrInvalidEvent rather
// than kept in memory.
const MaxKeyLength = 4096

// lifecycle is the monitor's state: New, releaseHold, Shutdown and
// beginStop move it forward, never back.
type lifecycle uint8

const (
	held     lifecycle = iota // WithDeferredStart: accepts, handles nothing, replays nothing
	running                   // accepts and handles
	draining                  // Shutdown: accepts nothing, handles what it holds
	stopped                   // Stop began: accepts nothing, takes no key (a call taken before runs on, cancelled)
)

func (s lifecycle) accepts() bool { return s == held || s == running }
func (s lifecycle) handles() bool { return s == running || s == draining }

// intakeEnded reports whether Shutdown or Stop was called. It turns true
// before the state changes; in between, accept still takes envelopes the
// stream reader holds, and Shutdown waits for the reader to notice. mu
// need not be held.
func (m *Monitor) intakeEnded() bool { return m.intake.Err() != nil }

// releaseHold ends WithDeferredStart's hold. mu is held.
func (m *Monitor) releaseHold() {
	if m.state == held {
		m.state = running
		m.reconcile()
	}
}

// Monitor handles typed events in order per key, with parallelism across
// keys and per-key exponential backoff. Create it with New; release it with
// Stop or Shutdown.
type Monitor struct {
	cfg     config
	handler Handler
	base    context.Context // parent of every handler's ctx: carries the logger

	// mu guards the fields from cond to abandonedDrops; every change that
	// can start work or unblock a waiter ends in reconcile, which also
	// wakes all who wait on cond.
	mu        sync.Mutex
	cond      sync.Cond
	state     lifecycle
	atStop    atStop // what the stop found, for Shutdown and WaitIdle
	keys      *keyq.Set[item]
	calls     []*call // in progress or being settled, in start order
	stats     Stats   // the counters; Stats derives the gauges
	sched     schedulerState
	stream    streamState
	accepting int // envelopes and exits taken in, not yet queued or dropped
	// abandonedDrops: a Drop for each call a stop gave up on, kept for
	// Shutdown to count.
	abandonedDrops []Drop

	intake    context.Context // ends when Shutdown or Stop is called
	endIntake context.CancelFunc
	watchers  sync.WaitGroup // the scheduler, Start's reader, exit watchers while they wait
	stopping  chan struct{}  // closed when Stop begins
	lifetime  chan error     // a bare Start's channel: closed when Stop is done
	stopOnce  sync.Once
}

// item is one accepted event in its key's queue; what only some need is
// behind pointers, as queues hold many.
type item struct {
	event    any
	origin   *origin   // nil for Submit, Backoff and WatchExit
	failures *failures // nil until the event fails
}

// origin is the envelope an event came from, for its drop and log lines.
type origin struct{ topic, namespace string }

func (it item) from() (topic, namespace string) {
	if it.origin == nil {
		return "", ""
	}
	return it.origin.topic, it.origin.namespace
}

type failures struct {
	attempts int // failed handler calls so far
	first    time.Time
	last     error
}

func (it item) attempts() int {
	if it.failures == nil {
		return 0
	}
	return it.failures.attempts
}

// New returns a Monitor that hands events to h. It starts no goroutine until
// there is something to do, so Submit works without a stream. Invalid
// options are reported together, wrapping ErrInvalidOption.
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
		cfg:     cfg,
		handler: h,
		base:    log.WithLogger(context.Background(), cfg.logger),
		state:   running,
		keys: keyq.New[item](keyq.Delays{Initial: cfg.initialBackoff, Max: cfg.maxBackoff,
			Jitter: cfg.jitter, Rand: rand.Float64}),
		sched:    schedulerState{wake: make(chan struct{}, 1)},
		stopping: make(chan struct{}),
		lifetime: make(chan error),
	}
	if cfg.deferredStart {
		m.state = held
	}
	m.cond.L = &m.mu
	m.intake, m.endIntake = context.WithCancel(context.Background())
	return m, nil
}

// reconcile runs after every change, under mu, and restores what must hold
// between changes: no backoff queue is past its due time while running (and
// none waits while draining); overran calls have given their slots to new
// workers, up to WithMaxOverruns; no slot is free while a key is ready; the
// timer is set for what is due next; and whoever waits on cond looks again.
func (m *Monitor) reconcile() {
	for k := m.keys.Earliest(); k != nil && m.replayDue(k); k = m.keys.Earliest() {
		m.keys.Replay(k)
		m.stats.Retried++
	}
	m.replaceStuck()
	for free := m.cfg.workers - m.slotsHeld(); free > 0; free-- {
		c := m.takeReady()
		if c == nil {
			break
		}
		go m.work(c)
	}
	m.retime()
	m.cond.Broadcast()
}

// replayDue reports whether k, the key due first, replays now. mu is held.
func (m *Monitor) replayDue(k *keyq.Key[item]) bool {
	switch m.state {
	case running:
		return !k.Due().After(m.cfg.clock.Now())
	case draining:
		return true
	}
	return false
}

// Submit hands the monitor an event that did not come from its stream (a
// relist, an exit). Once accepted (nil error) it is handled, ignored,
// forgotten or dropped, and in Stats' gauges until then; refused, the
// caller keeps it: ErrStopped once Shutdown or Stop began, ErrQueueFull,
// ErrInvalidEvent.
func (m *Monitor) Submit(key string, event any) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.accept(key, item{event: event}, submitted); err != nil {
		return err
	}
	m.reconcile()
	return nil
}

// Backoff puts event straight into key's backoff queue, behind what the key
// already holds. A key not yet in backoff waits the initial delay from now,
// and so does one replaying, though not before its replay is done. An event
// the monitor cannot take (stopped, full, invalid) goes to the drop handler.
func (m *Monitor) Backoff(key string, event any) {
	it := item{event: event}
	m.mu.Lock()
	var drops []Drop
	if _, err := m.accept(key, it, backedOff); err != nil {
		drops = m.refuse(key, it, err)
	}
	m.reconcile()
	m.mu.Unlock()
	m.emit(drops...)
}

// source is how an event reached the monitor.
type source uint8

const (
	submitted source = iota // Submit, or an exit
	backedOff               // Backoff: straight into its key's backoff
	streamed                // an envelope the stream reader took
)

// accept validates an event and queues it; once Shutdown or Stop was
// called, only an envelope the stream reader holds (see intakeEnded), and
// only until the drain begins. mu is held.
func (m *Monitor) accept(key string, it item, from source) (*keyq.Key[item], error) {
	switch {
	case !m.state.accepts(), from != streamed && m.intakeEnded():
		return nil, ErrStopped
	case key == "":
		return nil, fmt.Errorf("%w: empty key", ErrInvalidEvent)
	case len(key) > MaxKeyLength:
		return nil, fmt.Errorf("%w: key of %d bytes (max %d)", ErrInvalidEvent, len(key), MaxKeyLength)
	case it.event == nil:
		return nil, fmt.Errorf("%w: nil event for key %q", ErrInvalidEvent, key)
	}
	if limit := m.cfg.maxQueuedPerKey; limit > 0 {
		if k := m.keys.Get(key); k != nil && k.Len() >= limit {
			return nil, fmt.Errorf("%w: key %q is at WithMaxQueuedPerKey(%d)", ErrQueueFull, key, limit)
		}
	}
	m.stats.Received++
	if from == backedOff {
		return m.keys.PushBackoff(key, it, m.cfg.clock.Now()), nil
	}
	return m.keys.Push(key, it), nil
}

// InBackoff reports whether key is in backoff: waiting for its due time, or
// replaying (until the replay's last call ends, so that a key may be in
// backoff with no event left).
func (m *Monitor) InBackoff(key string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keys.Get(key)
	return k != nil && k.InBackoff()
}

// Forget removes and returns, in order, every event of key not yet started
// (in backoff or waiting for a worker), for when the object behind key is
// gone. A call in progress goes on. If it is a replay's, the key stays in
// backoff until it ends; if it fails, its event backs off as usual.
func (m *Monitor) Forget(key string) []any {
	m.mu.Lock()
	defer m.mu.Unlock()
	var events []any
	for _, it := range m.keys.Forget(key) {
		events = append(events, it.event)
	}
	m.stats.Forgotten += uint64(len(events))
	m.reconcile()
	return events
}
