package eventmonitor

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
)

// MaxKeyLength bounds a key's length in bytes. Container, sandbox and image
// names are far shorter; a longer key is refused as ErrInvalidEvent rather
// than kept in memory.
const MaxKeyLength = 4096

type runState int

const (
	stateRunning  runState = iota
	stateDraining          // Shutdown: no intake, queues still handled
	stateStopped
)

// Monitor handles typed events in order per key, with parallelism across
// keys and per-key exponential backoff. Create it with New; it runs until
// Stop or Shutdown.
type Monitor struct {
	cfg     config
	handler Handler
	base    context.Context // parent of every handler context: carries the logger
	epoch   time.Time       // the clock's reading at New; workers count from it

	timesCalls bool // calls read the clock: for their deadline, or for metrics

	mu              sync.Mutex
	workAvailable   sync.Cond // workers wait here for a ready key
	progress        sync.Cond // Stop, Shutdown and stream intake wait here
	progressWaiters int
	idleWorkers     int
	busy            int // goroutines Stop waits for: workers, inline exit calls
	holding         int // goroutines holding a key, from taking it to handing it back
	overrunning     int // calls past their deadline, still running
	reserved        int // events taken by runs, not yet settled (see run.go)
	runners         linkedList[runner, *runner]
	replaced        int // of those, calls whose worker a new one replaced
	abandonedCalls  int // calls Stop gave up waiting for
	state           runState
	held            bool // WithDeferredStart: nothing is handled until Start, Run or Shutdown
	keys            map[string]*keyState
	idleKeys        linkedList[keyState, *keyState] // idle keys still in keys, oldest first
	ready           fifo[*keyState]
	due             dueHeap
	calls           callList
	armed           bool // the scheduler will wake by wakeAt
	wakeAt          time.Time
	wakes           uint64 // requests to the scheduler to look again
	armedFor        uint64 // the requests its timer has taken into account
	queued          int    // events in queues, in backoff or not
	keysInBackoff   int
	eventsInBackoff int
	stats           Stats // counters only; gauges are filled in by Stats()
	abandonedDrops  []Drop
	subscribed      *subscription   // by Subscribe, for Start
	reading         bool            // a Run or Start's reader is reading a stream
	lifetimes       []chan error    // bare Starts' channels, closed by Stop
	ignoredURLs     map[string]bool // type URLs ignored so far, for logging once

	intaking      atomic.Int32    // stream batches read but not yet accepted
	stopping      atomic.Bool     // Stop has begun: runs take no further call
	intake        context.Context // ends when Stop or Shutdown begins
	cancelIntake  context.CancelFunc
	wake          chan struct{}
	quit          chan struct{}
	schedulerDone chan struct{}
	stopOnce      sync.Once
	stopped       chan struct{}
	goroutines    sync.WaitGroup // Start's reader and exit watchers
}

// New returns a running Monitor that hands events to h. Its workers and its
// scheduler start at once, so Submit works without a stream; release them
// with Stop or Shutdown. Invalid options are reported together, wrapping
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
		cfg:           cfg,
		handler:       h,
		base:          log.WithLogger(context.Background(), cfg.logger),
		epoch:         cfg.clock.Now(),
		timesCalls:    cfg.handleTimeout > 0 || cfg.metrics != nil,
		keys:          make(map[string]*keyState),
		busy:          cfg.workers,
		wakes:         1, // the scheduler's first pass
		wake:          make(chan struct{}, 1),
		quit:          make(chan struct{}),
		schedulerDone: make(chan struct{}),
		stopped:       make(chan struct{}),
		held:          cfg.deferredStart,
	}
	m.workAvailable.L = &m.mu
	m.progress.L = &m.mu
	m.intake, m.cancelIntake = context.WithCancel(context.Background())
	for range cfg.workers {
		go m.worker()
	}
	go m.scheduler()
	return m, nil
}

// sinceEpoch reads the clock as the time since New. Workers read it once
// per handler call: against the real clock it is one monotonic reading,
// half the cost of Now, which also reads the wall clock.
func (m *Monitor) sinceEpoch() time.Duration { return m.cfg.clock.Since(m.epoch) }

// Submit hands the monitor a typed event that did not come from its stream
// (a relist, an exit, a retry from elsewhere). A nil error means the event
// was accepted: it will be handled, or be in Pending, or reach the drop
// handler. An error means it was refused and the caller still owns it:
// ErrStopped after Stop or Shutdown began, ErrQueueFull, ErrInvalidEvent.
func (m *Monitor) Submit(key string, event any) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	k, err := m.accept(key, item{event: event})
	if err != nil {
		return err
	}
	m.schedule(k)
	return nil
}

// accept validates an event and appends it to its key's queue without
// scheduling the key. mu is held.
func (m *Monitor) accept(key string, it item) (*keyState, error) {
	if m.state != stateRunning {
		return nil, ErrStopped
	}
	if err := checkKey(key); err != nil {
		return nil, err
	}
	if it.event == nil {
		return nil, fmt.Errorf("%w: nil event for key %q", ErrInvalidEvent, key)
	}
	k := m.keyFor(key)
	if max := m.cfg.maxQueuedPerKey; max > 0 && k.queue.len() >= max {
		m.releaseIfIdle(k)
		return nil, fmt.Errorf("%w: key %q holds %d events", ErrQueueFull, key, max)
	}
	k.queue.push(it)
	m.queued++
	m.recount(k)
	m.stats.Received++
	return k, nil
}

func checkKey(key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidEvent)
	case len(key) > MaxKeyLength:
		return fmt.Errorf("%w: key of %d bytes (max %d)", ErrInvalidEvent, len(key), MaxKeyLength)
	}
	return nil
}

// Backoff puts event straight into key's backoff queue, behind what the key
// already holds. A key not yet in backoff waits the initial delay. An event
// the monitor cannot take (stopped, full, invalid) goes to the drop handler.
func (m *Monitor) Backoff(key string, event any) {
	m.mu.Lock()
	k, err := m.accept(key, item{event: event})
	if err != nil {
		d := m.refuseLocked(key, event, err)
		m.mu.Unlock()
		m.emit(d)
		return
	}
	if !k.inBackoff() {
		k.delay = m.cfg.initialBackoff
		m.wait(k)
		m.recount(k)
	}
	m.mu.Unlock()
}

// InBackoff reports whether key has events waiting in backoff or replaying.
func (m *Monitor) InBackoff(key string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	k, ok := m.keys[key]
	return ok && k.inBackoff()
}

// Forget removes every event of key that has not started handling (in
// backoff or waiting for a worker) and returns them in order; the caller now
// owns them. A call in progress for key is not affected. Use it when the
// object behind the key is gone.
func (m *Monitor) Forget(key string) []any {
	m.mu.Lock()
	defer m.mu.Unlock()
	k, ok := m.keys[key]
	if !ok {
		return nil
	}
	if k.heapIndex >= 0 {
		m.due.remove(k)
		m.wakeScheduler() // its timer may be set for this key
	}
	k.replayLeft, k.replayStarting = 0, false
	var events []any
	for _, it := range m.takeItems(k) {
		events = append(events, it.event)
	}
	m.stats.Forgotten += uint64(len(events))
	m.releaseIfIdle(k)
	return events
}

// takeItems empties k's queue and returns what it held. mu is held.
func (m *Monitor) takeItems(k *keyState) []item {
	items := slices.Clone(k.queue.all())
	for k.queue.len() > 0 {
		k.queue.pop()
	}
	m.queued -= len(items)
	m.recount(k)
	return items
}

// Pending is one key's backoff queue as Pending() saw it.
type Pending struct {
	Key      string
	Events   []any     // in the order they will be handled
	Attempts int       // failed handler calls of the event at the head
	Due      time.Time // when the queue replays (in the past while replaying)
}

// Pending returns a snapshot of every backoff queue, sorted by key.
func (m *Monitor) Pending() []Pending {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []Pending
	for _, k := range m.keys {
		if !k.inBackoff() {
			continue
		}
		p := Pending{Key: k.key, Due: m.epoch.Add(k.due), Events: make([]any, 0, k.queue.len())}
		for _, it := range k.queue.all() {
			p.Events = append(p.Events, it.event)
		}
		if k.queue.len() > 0 {
			p.Attempts = k.queue.peek().attempts()
		}
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Pending) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// WaitIdle waits until the monitor has done all it can with what it was
// given: no handler call running, no key waiting for a worker or held by one,
// no batch of stream envelopes being accepted, and no backoff replay due at
// the clock's now. What is left are keys waiting in backoff for a time still
// to come (see NextRetry). It returns ctx's error if ctx ends first, and
// ErrStopped once the monitor is stopped.
//
// It is the sync point of tests on a fake clock: Submit, WaitIdle, then step
// the clock to NextRetry and WaitIdle again, with no sleep and no race (the
// eventmonitortest package wraps these steps). Events count as given once
// Submit or Backoff returned, once WatchExit's channel closed, or once the
// stream reader took them from the subscription's channel; an envelope a
// test sends on an unbuffered channel is taken when the send returns, but
// WaitIdle may run in the instant before the reader notes it, so tests of
// stream intake should also wait for Stats().Received (or use
// testing/synctest, which sees every goroutine).
//
// A call that overruns its timeout keeps the monitor busy until it returns.
func (m *Monitor) WaitIdle(ctx context.Context) error {
	defer context.AfterFunc(ctx, func() {
		m.mu.Lock()
		m.progress.Broadcast()
		m.mu.Unlock()
	})()
	m.mu.Lock()
	defer m.mu.Unlock()
	for !m.idle() {
		switch {
		case m.state == stateStopped:
			return ErrStopped
		case ctx.Err() != nil:
			return ctx.Err()
		}
		m.waitProgress()
	}
	return nil
}

// idle reports what WaitIdle waits for. Once nothing else moves, it also
// has the scheduler drop a timer armed for the deadline of a call that has
// returned since, so that an idle monitor holds no timer on its clock but
// for the next retry. mu is held.
func (m *Monitor) idle() bool {
	quiet := m.holding == 0 && m.calls.n == 0 && (m.held || m.ready.len() == 0) && m.intaking.Load() == 0 &&
		(m.held || len(m.due) == 0 || m.due[0].due > m.sinceEpoch())
	if !quiet || m.armedFor != m.wakes {
		return false
	}
	wantsTimer := len(m.due) > 0 && !m.held // a held monitor replays nothing: no timer
	if !wantsTimer && !m.armed || wantsTimer && m.armed && m.wakeAt.Equal(m.epoch.Add(m.due[0].due)) {
		return true
	}
	m.wakeScheduler()
	return false
}

// NextRetry returns when the next backoff replay is due, and false if no
// key is waiting in backoff.
func (m *Monitor) NextRetry() (time.Time, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.due) == 0 {
		return time.Time{}, false
	}
	return m.epoch.Add(m.due[0].due), true
}

// Stats holds the monitor's counters and gauges.
//
// Every event accepted is counted once in Received and ends in exactly one
// of Handled, Dropped, Forgotten, or the gauges Queued, EventsInBackoff and
// InFlight; envelopes of other namespaces are Received and Filtered, and
// envelopes of a type the converter has no key for are Received and Ignored.
type Stats struct {
	// Received: every envelope read and every accepted Submit or Backoff;
	// Filtered: envelopes of other namespaces; Ignored: envelopes whose type
	// the converter does not key (ErrUnsupportedEvent), which are not ours
	// to handle and so not drops; Handled: successful handler calls; Failed:
	// failed ones (panics too); Retried: backoff replays started; Dropped:
	// events handed to the drop handler; Forgotten: events returned by
	// Forget; Resubscribed: Run's re-subscriptions.
	Received, Filtered, Ignored, Handled, Failed, Retried, Dropped, Forgotten, Resubscribed uint64
	// InFlight: handler calls running, Overrunning among them; Overrunning:
	// calls past their handle timeout that have not returned (each holds its
	// key; see WithMaxOverruns); Queued: events waiting for a worker;
	// KeysInBackoff, EventsInBackoff: keys and events waiting or replaying.
	InFlight, Overrunning, Queued, KeysInBackoff, EventsInBackoff int
}

// Stats returns a consistent snapshot of the counters and gauges.
func (m *Monitor) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	s.InFlight = m.calls.n + m.runners.n // a run has a call in progress, or is about to
	s.Overrunning = m.overrunning
	s.Queued = m.queued - m.eventsInBackoff + m.reserved - m.runners.n // a run's events count as queued until it settles
	s.KeysInBackoff = m.keysInBackoff
	s.EventsInBackoff = m.eventsInBackoff
	return s
}

// Drop is an event, or an envelope that never became one, that the monitor
// gave up on.
type Drop struct {
	Key    string
	Events []any // nil when the envelope could not be decoded
	Reason error // wraps ErrDecode, ErrInvalidEvent, ErrMaxAttempts, ErrQueueFull or ErrStopped
	// Topic and Namespace are the envelope's, for events that came from the
	// stream; "" for events from Submit, Backoff and WatchExit.
	Topic, Namespace string
}

// String says what was dropped, where it came from and why, for a log line
// a person can act on.
func (d Drop) String() string {
	var b strings.Builder
	switch n := len(d.Events); {
	case n == 0:
		b.WriteString("dropped an envelope that did not become an event")
	case n == 1:
		b.WriteString("dropped 1 event")
	default:
		fmt.Fprintf(&b, "dropped %d events", n)
	}
	if d.Key != "" {
		fmt.Fprintf(&b, " of key %q", d.Key)
	}
	if d.Topic != "" || d.Namespace != "" {
		fmt.Fprintf(&b, " (topic %q, namespace %q)", d.Topic, d.Namespace)
	}
	fmt.Fprintf(&b, ": %v", d.Reason)
	return b.String()
}

// dropLocked counts a drop and returns it for emit, which runs without mu.
func (m *Monitor) dropLocked(key string, events []any, reason error) Drop {
	m.stats.Dropped += uint64(max(1, len(events)))
	return Drop{Key: key, Events: events, Reason: reason}
}

// refuseLocked drops an event that arrived with no caller to refuse it to
// (from the stream, an exit watcher or Backoff): it counts as received and
// dropped, so Stats still accounts for it. event may be nil. mu is held.
func (m *Monitor) refuseLocked(key string, event any, reason error) Drop {
	m.stats.Received++
	var events []any
	if event != nil {
		events = []any{event}
	}
	return m.dropLocked(key, events, reason)
}

// emit hands a drop to the drop handler; a panicking drop handler is logged
// rather than allowed to take a worker or the stream down.
func (m *Monitor) emit(d Drop) {
	if mt := m.cfg.metrics; mt != nil {
		mt.Dropped(d.Reason, max(1, len(d.Events)))
	}
	defer func() {
		if r := recover(); r != nil {
			m.cfg.logger.WithField("key", d.Key).Errorf("drop handler panicked: %v", r)
		}
	}()
	m.cfg.onDrop(d)
}

func logDrop(l *log.Entry) func(Drop) {
	return func(d Drop) {
		fields := log.Fields{"key": d.Key, "events": len(d.Events)}
		if d.Topic != "" || d.Namespace != "" {
			fields["topic"], fields["namespace"] = d.Topic, d.Namespace
		}
		l.WithFields(fields).WithError(d.Reason).Warn("event dropped")
	}
}

// Stop ends intake, cancels the context of every call in progress and waits
// for those calls to return; a call still running when it overruns (its
// deadline plus a grace, see WithHandleTimeout) is abandoned (its event
// dropped), so Stop returns within about the handle timeout even if a
// handler ignores its context. Then every event not yet handled, queued or
// in backoff, goes to the drop handler with ErrStopped. Stop is idempotent
// and safe to call from several goroutines.
//
// Do not call Stop from a handler: it would wait for that very call until
// it overruns, then report its event dropped (with WithHandleTimeout(0), for
// ever). Call go m.Stop() instead.
func (m *Monitor) Stop() {
	m.stopOnce.Do(m.stop)
	<-m.stopped
}

func (m *Monitor) stop() {
	m.cancelIntake()
	m.stopping.Store(true) // before looking for runs' calls: see runEvents
	m.mu.Lock()
	m.state = stateStopped
	for c := m.calls.head; c != nil; c = c.link.next {
		c.end(endedCanceled)
	}
	for r := m.runners.head; r != nil; r = r.link.next {
		if c := r.current.Load(); c != nil {
			c.end(endedCanceled)
		}
	}
	m.workAvailable.Broadcast()
	m.progress.Broadcast()
	m.wakeScheduler() // to abandon calls already past their deadline
	for m.busy > 0 {
		m.waitProgress()
	}
	drops := m.abandonedDrops
	m.abandonedDrops = nil
	keys := make([]string, 0, len(m.keys))
	for key := range m.keys {
		keys = append(keys, key)
	}
	slices.Sort(keys)
	for _, key := range keys {
		k := m.keys[key]
		if k.heapIndex >= 0 {
			m.due.remove(k)
		}
		k.replayLeft, k.replayInFlight, k.replayStarting = 0, false, false // an abandoned call's key is done too
		drops = append(drops, m.dropByOrigin(key, m.takeItems(k), ErrStopped)...)
	}
	lifetimes := m.lifetimes
	m.lifetimes = nil
	m.mu.Unlock()
	close(m.quit)
	<-m.schedulerDone
	m.goroutines.Wait()
	for _, d := range drops {
		m.emit(d)
	}
	for _, ch := range lifetimes {
		close(ch)
	}
	close(m.stopped)
}

// dropByOrigin drops a key's events, one Drop for each run of events that
// came from the same topic and namespace, so that every Drop says where its
// events came from. mu is held.
func (m *Monitor) dropByOrigin(key string, items []item, reason error) []Drop {
	var drops []Drop
	for len(items) > 0 {
		topic, namespace := items[0].origin()
		events := []any{items[0].event}
		for _, it := range items[1:] {
			if t, ns := it.origin(); t != topic || ns != namespace {
				break
			}
			events = append(events, it.event)
		}
		d := m.dropLocked(key, events, reason)
		d.Topic, d.Namespace = topic, namespace
		drops = append(drops, d)
		items = items[len(events):]
	}
	return drops
}

// waitProgress waits on the progress condition. mu is held.
func (m *Monitor) waitProgress() {
	m.progressWaiters++
	m.progress.Wait()
	m.progressWaiters--
}

// Shutdown stops intake (Submit returns ErrStopped from now on), handles
// everything queued, replays every backoff queue once at once, then Stops.
// An event that fails during the shutdown, or is still waiting when ctx
// ends, goes to the drop handler with ErrStopped.
//
// A handler call that overruns its timeout does not hold Shutdown up: once
// everything else is handled and only such calls (and the events of their
// keys) are left, Shutdown stops, and Stop abandons them at their deadline
// as it always does. Shutdown therefore returns within about one handle
// timeout of the drain's end, whatever ctx. It returns ctx's error if ctx
// ended before everything was handled, and an error wrapping ErrStopped if
// it had to abandon calls that never returned.
func (m *Monitor) Shutdown(ctx context.Context) error {
	m.cancelIntake()
	m.mu.Lock()
	m.releaseHold() // a drain handles what is queued, held or not
	if m.state == stateRunning {
		m.state = stateDraining
		for len(m.due) > 0 {
			m.startReplay(m.due[0])
		}
		m.progress.Broadcast() // stream intake waiting for room gives up
	}
	stopWaking := context.AfterFunc(ctx, func() {
		m.mu.Lock()
		m.progress.Broadcast()
		m.mu.Unlock()
	})
	for m.state == stateDraining && ctx.Err() == nil && m.drainable() {
		m.waitProgress()
	}
	drained := m.queued == 0 && m.calls.n == 0 && m.runners.n == 0
	m.mu.Unlock()
	stopWaking()
	m.Stop()
	if drained {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("eventmonitor: shutdown: %w", err)
	}
	m.mu.Lock()
	abandoned := m.abandonedCalls
	m.mu.Unlock()
	if abandoned > 0 {
		return fmt.Errorf("%w: shutdown abandoned %d handler calls that overran their timeout", ErrStopped, abandoned)
	}
	return nil
}

// drainable reports whether a drain can still make progress: a call within
// its deadline is running, or an event is queued that is not held behind a
// call past its deadline. mu is held.
func (m *Monitor) drainable() bool {
	if m.calls.n+m.runners.n > m.overrunning {
		return true
	}
	held := 0
	for c := m.calls.head; c != nil; c = c.link.next {
		if c.expired {
			held += m.keys[c.key].queue.len()
		}
	}
	return m.queued > held
}

// releaseHold ends WithDeferredStart's hold: workers take the keys that
// became ready, and the scheduler replays what came due. mu is held.
func (m *Monitor) releaseHold() {
	if !m.held {
		return
	}
	m.held = false
	m.workAvailable.Broadcast()
	m.wakeScheduler()
}
