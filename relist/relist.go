package relist

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	"k8s.io/utils/clock"

	"github.com/eventmonitor/eventmonitor"
)

// State is a container's state as the runtime lists it.
type State string

const (
	StateRunning     State = "running"
	StateExited      State = "exited"
	StateUnknown     State = "unknown"
	StateNonExistent State = "non-existent"
)

// Container is one container (or sandbox) of a listing.
type Container struct {
	ID    string
	State State
}

// Pod is a pod of a listing; its sandboxes are containers too.
type Pod struct {
	ID         string
	Containers []Container
}

// EventType is the kind of lifecycle change.
type EventType string

const (
	ContainerStarted EventType = "ContainerStarted"
	ContainerDied    EventType = "ContainerDied"
	ContainerRemoved EventType = "ContainerRemoved"
	ContainerChanged EventType = "ContainerChanged"
)

// Event is one lifecycle change found by a relist.
type Event struct {
	PodID       string
	Type        EventType
	ContainerID string
}

// ListFunc lists every pod with its containers.
type ListFunc func(ctx context.Context) ([]Pod, error)

// Option configures a Relister.
type Option func(*Relister)

// WithPeriod sets how often Run relists (default 1 s).
func WithPeriod(d time.Duration) Option { return func(r *Relister) { r.period = d } }

// WithThreshold sets how long after the last relist Healthy starts to err (default 3 min).
func WithThreshold(d time.Duration) Option { return func(r *Relister) { r.threshold = d } }

// WithClock sets the clock behind the period and the health check.
func WithClock(c clock.WithTicker) Option { return func(r *Relister) { r.clock = c } }

// WithInspect sets a function called for every pod with changes before its
// events are emitted (pod nil: the pod is gone), to refresh what the
// runtime's caller keeps about it. An error keeps the pod's old record: its
// events are not emitted now and come again next relist.
func WithInspect(fn func(ctx context.Context, podID string, pod *Pod) error) Option {
	return func(r *Relister) { r.inspect = fn }
}

// WithChangedEvents emits ContainerChanged when a container turns unknown
// (default off, as in kubelet).
func WithChangedEvents(on bool) Option { return func(r *Relister) { r.changedEvents = on } }

// WithInspectWorkers sets how many pods are inspected at once (default 4).
func WithInspectWorkers(n int) Option { return func(r *Relister) { r.workers = n } }

// Relister compares successive listings and emits the differences.
type Relister struct {
	list          ListFunc
	sink          func(ctx context.Context, e Event) error
	period        time.Duration
	threshold     time.Duration
	clock         clock.WithTicker
	inspect       func(ctx context.Context, podID string, pod *Pod) error
	changedEvents bool
	workers       int

	relisting  sync.Mutex // one relist at a time (Run and a resync hook may race)
	records    map[string]*record
	generation uint64

	healthMu   sync.Mutex
	lastListed time.Time // when the last relist that listed successfully started
}

// record is what the sink was last told about one pod.
type record struct {
	containers []Container
	states     map[string]State // containers by ID, for pods too big to scan; nil until needed
	seen       uint64           // the generation of the last listing that had the pod
	reinspect  bool             // the last inspection failed: inspect again even if unchanged
}

// setContainers replaces the record's containers, keeping its array.
func (rec *record) setContainers(containers []Container) {
	rec.containers = append(rec.containers[:0], containers...)
	rec.states = nil
}

// New returns a Relister that lists with list and hands every event to sink.
// Nonsensical option values (a period, threshold or worker count below 1)
// fall back to the defaults. A nil list or sink is a programming error: New
// panics at once.
//
// sink is called from one goroutine at a time, never concurrently: for each
// relist, pod by pod in listing order (pods gone from the listing last, by
// ID), each pod's events in the order of its listed containers, once the
// pod's inspection succeeded. Inspections of different pods run in parallel
// (WithInspectWorkers); a pod's events wait for its own inspection and for
// the pods before it, so the sink sees one deterministic order.
func New(list ListFunc, sink func(ctx context.Context, e Event) error, opts ...Option) *Relister {
	switch {
	case list == nil:
		panic("relist: New with a nil ListFunc")
	case sink == nil:
		panic("relist: New with a nil sink")
	}
	r := &Relister{
		list:      list,
		sink:      sink,
		period:    time.Second,
		threshold: 3 * time.Minute,
		clock:     clock.RealClock{},
		workers:   4,
		records:   make(map[string]*record),
	}
	for _, opt := range opts {
		opt(r)
	}
	if r.period <= 0 {
		r.period = time.Second
	}
	if r.threshold <= 0 {
		r.threshold = 3 * time.Minute
	}
	if r.workers < 1 {
		r.workers = 4
	}
	if r.clock == nil {
		r.clock = clock.RealClock{}
	}
	return r
}

// ToMonitor returns a sink that submits each event to m keyed by pod ID, so
// relist events are ordered and backed off like stream events. A refused
// event (the monitor is stopped or the pod's queue is full) fails the sink,
// so the event, and the pod's later ones, come again next relist.
func ToMonitor(m *eventmonitor.Monitor) func(ctx context.Context, e Event) error {
	return func(ctx context.Context, e Event) error { return m.Submit(e.PodID, e) }
}

// Healthy returns nil if the last relist that listed successfully started
// within the threshold, and an error before the first one.
func (r *Relister) Healthy() error {
	r.healthMu.Lock()
	last := r.lastListed
	r.healthMu.Unlock()
	if last.IsZero() {
		return errors.New("relist: no relist has listed yet")
	}
	if since := r.clock.Since(last); since > r.threshold {
		return fmt.Errorf("relist: last relist was %v ago; threshold %v", since, r.threshold)
	}
	return nil
}

// Observe records a container state learnt elsewhere (from the event
// stream, in hybrid mode), so the next relist compares the listing with the
// freshest state known rather than with its own last listing. Without it, a
// change that the stream reported and a later one it lost can cancel out
// between two listings: the relist saw exited, the stream then delivered
// running and lost the next exit, and the listing still says exited.
// StateNonExistent forgets the container. Observe waits for a relist in
// progress to finish.
func (r *Relister) Observe(podID string, c Container) {
	r.relisting.Lock()
	defer r.relisting.Unlock()
	rec := r.records[podID]
	if rec == nil {
		if c.State == StateNonExistent {
			return
		}
		rec = &record{seen: r.generation}
		r.records[podID] = rec
	}
	rec.states = nil
	for i := range rec.containers {
		if rec.containers[i].ID == c.ID {
			if c.State == StateNonExistent {
				rec.containers = append(rec.containers[:i], rec.containers[i+1:]...)
			} else {
				rec.containers[i].State = c.State
			}
			return
		}
	}
	if c.State != StateNonExistent {
		rec.containers = append(rec.containers, c)
	}
}

// Run relists every period until ctx ends. Errors are logged; Healthy
// reports a relister that stopped listing.
func (r *Relister) Run(ctx context.Context) {
	ticker := r.clock.NewTicker(r.period)
	defer ticker.Stop()
	for {
		if err := r.Relist(ctx); err != nil && ctx.Err() == nil {
			log.G(ctx).WithError(err).Warn("relist failed")
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C():
		}
	}
}

// podWork is one pod whose record may change in this relist.
type podWork struct {
	id     string
	pod    *Pod // nil: the pod is gone
	events []Event
}

// Relist lists once and emits what changed since the last listing. A list
// error changes nothing and is returned; inspect and sink errors are joined
// into the returned error, and their pods are tried again next relist.
func (r *Relister) Relist(ctx context.Context) error {
	r.relisting.Lock()
	defer r.relisting.Unlock()
	started := r.clock.Now()
	pods, err := r.list(ctx)
	if err != nil {
		return fmt.Errorf("relist: list: %w", err)
	}
	r.healthMu.Lock()
	r.lastListed = started
	r.healthMu.Unlock()

	r.generation++
	var work []podWork
	for i := range pods {
		pod := &pods[i]
		rec := r.records[pod.ID]
		if rec == nil {
			rec = &record{}
			r.records[pod.ID] = rec
		}
		rec.seen = r.generation
		if !rec.reinspect && sameContainers(rec, pod.Containers) {
			continue // the common case: nothing to allocate, nothing to emit
		}
		work = append(work, podWork{id: pod.ID, pod: pod, events: r.diff(pod.ID, rec.containers, pod.Containers)})
	}
	listed := len(work)
	for id, rec := range r.records {
		if rec.seen != r.generation {
			work = append(work, podWork{id: id, events: r.diff(id, rec.containers, nil)})
		}
	}
	slices.SortFunc(work[listed:], func(a, b podWork) int { return strings.Compare(a.id, b.id) })
	return r.apply(ctx, work)
}

// scanLimit is the pod size up to which a reordered listing is compared by
// scanning: a few dozen string comparisons cost less than a map lookup each.
const scanLimit = 16

// sameContainers reports whether a listing of a pod's containers says what
// the record says, in whatever order: runtimes list a pod's containers in no
// fixed order (containerd's CRI in Go map order), and a pod that only
// reordered has not changed. Container IDs are unique within a pod.
func sameContainers(rec *record, listing []Container) bool {
	old := rec.containers
	if len(old) != len(listing) {
		return false
	}
	i := 0
	for i < len(old) && old[i] == listing[i] { // the common case: the same order
		i++
	}
	if i == len(old) {
		return true
	}
	if len(old) <= scanLimit {
		for _, c := range listing[i:] {
			if !slices.Contains(old[i:], c) {
				return false
			}
		}
		return true
	}
	if rec.states == nil {
		rec.states = make(map[string]State, len(old))
		for _, c := range old {
			rec.states[c.ID] = c.State
		}
	}
	for _, c := range listing[i:] {
		if state, ok := rec.states[c.ID]; !ok || state != c.State {
			return false
		}
	}
	return true
}

// apply inspects the changed pods on the inspect workers and, on this
// goroutine, hands their events to the sink in work's order, each pod's as
// soon as its inspection and the pods before it are done; then it commits
// the records of the pods that succeeded.
func (r *Relister) apply(ctx context.Context, work []podWork) error {
	if len(work) == 0 {
		return nil
	}
	inspected := r.inspectAll(ctx, work)
	errs := make([]error, len(work))
	sunk := make([]int, len(work))
	for i, w := range work {
		if err := <-inspected[i]; err != nil {
			errs[i] = err
			continue
		}
		sunk[i], errs[i] = r.sinkPod(ctx, w)
	}

	for i, w := range work {
		rec := r.records[w.id]
		switch {
		case errs[i] != nil:
			rec.advance(w.events[:sunk[i]]) // the rest comes again next relist, not what the sink took
			rec.reinspect = true
		case w.pod == nil:
			delete(r.records, w.id)
		default:
			rec.setContainers(w.pod.Containers)
			rec.reinspect = false
		}
	}
	return errors.Join(errs...)
}

// inspectAll starts inspecting work's pods on up to WithInspectWorkers
// goroutines and returns where each pod's result arrives; all of them have
// arrived by the time the caller has read them all.
func (r *Relister) inspectAll(ctx context.Context, work []podWork) []chan error {
	inspected := make([]chan error, len(work))
	for i := range inspected {
		inspected[i] = make(chan error, 1)
	}
	if r.inspect == nil {
		for _, ch := range inspected {
			ch <- nil
		}
		return inspected
	}
	next := make(chan int)
	for range min(r.workers, len(work)) {
		go func() {
			for i := range next {
				if err := r.inspect(ctx, work[i].id, work[i].pod); err != nil {
					inspected[i] <- fmt.Errorf("relist: inspect pod %s: %w", work[i].id, err)
					continue
				}
				inspected[i] <- nil
			}
		}()
	}
	go func() {
		defer close(next)
		for i := range work {
			next <- i
		}
	}()
	return inspected
}

// sinkPod hands w's events to the sink until one fails, returning how many
// it took.
func (r *Relister) sinkPod(ctx context.Context, w podWork) (int, error) {
	for i, e := range w.events {
		if err := r.sink(ctx, e); err != nil {
			return i, fmt.Errorf("relist: pod %s: %s %s: %w", w.id, e.Type, e.ContainerID, err)
		}
	}
	return len(w.events), nil
}

// advance applies events the sink took to the record, so that a relist
// after a failed sink call emits only what the sink has not taken.
func (rec *record) advance(events []Event) {
	for _, e := range events {
		i := slices.IndexFunc(rec.containers, func(c Container) bool { return c.ID == e.ContainerID })
		if e.Type == ContainerRemoved {
			if i >= 0 {
				rec.containers = slices.Delete(rec.containers, i, i+1)
			}
			continue
		}
		state := map[EventType]State{ContainerStarted: StateRunning, ContainerDied: StateExited, ContainerChanged: StateUnknown}[e.Type]
		if i < 0 {
			rec.containers = append(rec.containers, Container{ID: e.ContainerID, State: state})
		} else {
			rec.containers[i].State = state
		}
	}
	rec.states = nil
}

// diff lists the events that turn old into new: containers in new's order,
// then those that vanished in old's order.
func (r *Relister) diff(podID string, old, new []Container) []Event {
	oldState := make(map[string]State, len(old))
	for _, c := range old {
		oldState[c.ID] = c.State
	}
	var events []Event
	emit := func(id string, from, to State) {
		for _, t := range r.transition(from, to) {
			events = append(events, Event{PodID: podID, Type: t, ContainerID: id})
		}
	}
	listed := make(map[string]bool, len(new))
	for _, c := range new {
		listed[c.ID] = true
		from, ok := oldState[c.ID]
		if !ok {
			from = StateNonExistent
		}
		emit(c.ID, from, c.State)
	}
	for _, c := range old {
		if !listed[c.ID] {
			emit(c.ID, c.State, StateNonExistent)
		}
	}
	return events
}

// transition is the design's table of events for one container.
func (r *Relister) transition(from, to State) []EventType {
	if from == to {
		return nil
	}
	switch to {
	case StateRunning:
		return []EventType{ContainerStarted}
	case StateExited:
		return []EventType{ContainerDied}
	case StateUnknown:
		if r.changedEvents {
			return []EventType{ContainerChanged}
		}
		return nil
	case StateNonExistent:
		if from == StateExited {
			return []EventType{ContainerRemoved}
		}
		return []EventType{ContainerDied, ContainerRemoved}
	}
	return nil
}
