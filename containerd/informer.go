package containerd

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/containerd/log"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"k8s.io/utils/clock"

	"github.com/eventmonitor/eventmonitor"
)

// Change is one change to a cached object: added (Old nil), updated, or
// deleted (New nil, and Old the tombstone: the last state known).
type Change[T any] struct{ Old, New *T }

// Informer keeps a cached view of one containerd namespace's objects of one
// kind (NewContainerInformer, NewImageInformer), right across daemon
// restarts, and hands every change to a handler, in order per object. See
// the package doc for how it stays right.
type Informer[T any] struct {
	kind      kind[T]
	cfg       informerConfig
	conn      grpc.ClientConnInterface
	namespace string
	intake    *eventmonitor.Monitor // applies events and listings to the cache, one object at a time
	deliver   *eventmonitor.Monitor // hands changes to the handler, in order per object
	relisting sync.Mutex            // one relist at a time

	mu         sync.RWMutex
	objects    map[string]cached[T]
	gone       map[string]time.Time // when deleted objects were seen gone, until a relist covers them
	floor      time.Time            // when the last relist began: older news of an unknown object is stale
	refreshing map[string]bool      // objects with a refresh queued
	stats      InformerStats
	synced     chan struct{}
	ran        bool
}

// cached is an object and when the newest news of it began: an event's
// timestamp, or when the listing or read that showed it began.
type cached[T any] struct {
	obj     *T
	version time.Time
}

// InformerStats are an informer's counters; Monitor().Stats() has its
// deliveries'.
type InformerStats struct {
	Objects      int           // cached now
	Resubscribed uint64        // subscriptions established after an outage: one per outage
	Relists      uint64        // full listings applied to the cache
	Refreshes    uint64        // single objects read again (Resync, or after news newer than a listing)
	Corrections  uint64        // changes that only a listing or a read found: the stream had missed them
	LastRelist   time.Duration // from the last relist's start until its listing was applied
}

// readTimeout bounds one read of the daemon, and listTimeout a listing;
// both on the real clock, as gRPC reads them.
const (
	readTimeout = 10 * time.Second
	listTimeout = time.Minute
)

// rpc is ctx for one read in namespace: its namespace header, and
// readTimeout.
func rpc(ctx context.Context, namespace string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	return metadata.AppendToOutgoingContext(ctx, namespaceHeader, namespace), cancel
}

// kind is what the engine needs of one kind of object.
type kind[T any] interface {
	noun() string
	// keys key the events that change objects of the kind.
	keys() []eventmonitor.TypeKey
	// list returns the daemon's objects; read one, nil if there is none.
	list(ctx context.Context) (map[string]*T, error)
	read(ctx context.Context, id string) (*T, error)
	// apply returns the states an event of time at moves cur (nil:
	// unknown) through, nil for gone; none if it changes nothing.
	// refresh: cur is unknown and must be read.
	apply(ctx context.Context, id string, cur *T, event any, at time.Time) (states []*T, refresh bool, err error)
	// additive reports whether an event only adds what nothing else says
	// (a task's OOM): it applies even when older news came first.
	additive(event any) bool
	// reconcile returns the states a listing (listed nil: not listed)
	// moves cur through.
	reconcile(id string, cur, listed *T) []*T
	equal(a, b *T) bool
}

// runner is a kind with work of its own while the informer runs, whose
// news it submits to the intake; settled tells it an object's new state.
type runner[T any] interface {
	run(ctx context.Context, submit func(id string, news any) error) (wait func())
	settled(id string, obj *T)
}

// InformerOption configures an informer.
type InformerOption func(*informerConfig)

type informerConfig struct {
	clock        clock.WithTicker
	logger       *log.Entry
	relistPeriod time.Duration
	delivery     []eventmonitor.Option
}

// WithRelistPeriod sets how often the informer lists everything again as a
// safety net, beside the listing after every (re)subscription; default
// 1 min, 0 for never.
func WithRelistPeriod(d time.Duration) InformerOption {
	return func(c *informerConfig) { c.relistPeriod = d }
}

// WithClock sets the informer's clock, for its monitors and timers too;
// default the real one.
func WithClock(clk clock.WithTicker) InformerOption {
	return func(c *informerConfig) { c.clock = clk }
}

// WithLogger sets the informer's logger; default log.L.
func WithLogger(l *log.Entry) InformerOption { return func(c *informerConfig) { c.logger = l } }

// WithDelivery passes options to the monitor that delivers changes to the
// handler (workers, backoff, handle timeout, metrics, drop handler).
func WithDelivery(opts ...eventmonitor.Option) InformerOption {
	return func(c *informerConfig) { c.delivery = append(c.delivery, opts...) }
}

func newInformer[T any](conn grpc.ClientConnInterface, namespace string, k kind[T],
	h func(ctx context.Context, c Change[T]) error, opts []InformerOption) (*Informer[T], error) {
	switch {
	case conn == nil:
		return nil, errors.New("containerd: informer with a nil connection")
	case namespace == "":
		return nil, errors.New("containerd: informer with no namespace")
	case h == nil:
		return nil, errors.New("containerd: informer with a nil handler")
	}
	cfg := informerConfig{clock: clock.RealClock{}, logger: log.L, relistPeriod: time.Minute}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.relistPeriod < 0 {
		return nil, fmt.Errorf("containerd: WithRelistPeriod(%v): want >= 0", cfg.relistPeriod)
	}
	inf := &Informer[T]{kind: k, cfg: cfg, conn: conn, namespace: namespace, objects: map[string]cached[T]{}, gone: map[string]time.Time{},
		refreshing: map[string]bool{}, synced: make(chan struct{})}
	logger := cfg.logger.WithFields(log.Fields{"informer": k.noun(), "namespace": namespace})
	var err error
	inf.deliver, err = eventmonitor.New(eventmonitor.HandlerFunc(func(ctx context.Context, e any) error {
		return h(ctx, e.(Change[T]))
	}), append([]eventmonitor.Option{eventmonitor.WithClock(cfg.clock), eventmonitor.WithLogger(logger)}, cfg.delivery...)...)
	if err != nil {
		return nil, fmt.Errorf("containerd: informer: WithDelivery: %w", err)
	}
	inf.intake = eventmonitor.MustNew(eventmonitor.HandlerFunc(inf.apply),
		eventmonitor.WithNamespace(namespace),
		eventmonitor.WithConverter(eventmonitor.NewConverter(k.keys()...)),
		eventmonitor.WithWorkers(4),
		eventmonitor.WithBackoff(100*time.Millisecond, time.Second),              // a read failed: the daemon is back soon
		eventmonitor.WithHandleTimeout(0),                                        // apply bounds its reads by the real time
		eventmonitor.WithResubscribe(100*time.Millisecond, 500*time.Millisecond), // up to date within a second of the daemon's return
		eventmonitor.WithClock(cfg.clock), eventmonitor.WithLogger(logger),
		eventmonitor.WithResync(inf.relist),
		eventmonitor.WithDropHandler(func(d eventmonitor.Drop) {
			entry := logger.WithError(d.Reason).WithField("id", d.Key)
			if errors.Is(d.Reason, eventmonitor.ErrStopped) {
				entry.Debug("containerd: informer stopped before applying news") // Run's ctx ended
			} else {
				entry.Warn("containerd: informer dropped news it could not apply")
			}
		}))
	return inf, nil
}

// Run subscribes to the namespace's events, lists, and keeps the cache and
// the handler up to date until ctx ends, re-subscribing and listing again
// after every outage. It may be called once.
func (inf *Informer[T]) Run(ctx context.Context) error {
	inf.mu.Lock()
	ran := inf.ran
	inf.ran = true
	inf.mu.Unlock()
	if ran {
		return errors.New("containerd: informer: Run called twice")
	}
	filters, err := Filters(inf.namespace, inf.kind.keys()...)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	var periodic sync.WaitGroup
	if d := inf.cfg.relistPeriod; d > 0 {
		periodic.Add(1)
		go func() {
			defer periodic.Done()
			inf.relistEvery(ctx, d)
		}()
	}
	kindDone := func() {}
	if r, ok := inf.kind.(runner[T]); ok {
		kindDone = r.run(ctx, inf.intake.Submit)
	}
	err = inf.intake.Run(ctx, NewSubscriber(inf.conn), filters...)
	cancel()
	periodic.Wait()
	inf.intake.Stop()
	kindDone() // after the intake's calls, which may start exit waits
	inf.deliver.Stop()
	if errors.Is(err, eventmonitor.ErrStopped) {
		err = nil
	}
	return err
}

// relistEvery lists everything again every d until ctx ends.
func (inf *Informer[T]) relistEvery(ctx context.Context, d time.Duration) {
	ticker := inf.cfg.clock.NewTicker(d)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C():
			if err := inf.relist(ctx); err != nil && ctx.Err() == nil {
				inf.cfg.logger.WithError(err).Warn("containerd: periodic relist failed")
			}
		}
	}
}

// HasSynced reports whether the first listing is in the cache.
func (inf *Informer[T]) HasSynced() bool {
	select {
	case <-inf.synced:
		return true
	default:
		return false
	}
}

// WaitForSync waits until the first listing is in the cache, or ctx ends.
func (inf *Informer[T]) WaitForSync(ctx context.Context) error {
	select {
	case <-inf.synced:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Get returns the cached object with id. Treat it, and its maps, as
// read-only: the cache shares them.
func (inf *Informer[T]) Get(id string) (T, bool) {
	inf.mu.RLock()
	defer inf.mu.RUnlock()
	c, ok := inf.objects[id]
	if !ok {
		var zero T
		return zero, false
	}
	return *c.obj, true
}

// List returns every cached object, sorted by ID; read-only, as Get's.
func (inf *Informer[T]) List() []T {
	inf.mu.RLock()
	defer inf.mu.RUnlock()
	out := make([]T, 0, len(inf.objects))
	for _, id := range slices.Sorted(maps.Keys(inf.objects)) {
		out = append(out, *inf.objects[id].obj)
	}
	return out
}

// Resync reads the object with id from the daemon again, once for any
// number of calls before the read begins, and applies what it finds.
func (inf *Informer[T]) Resync(id string) {
	inf.mu.Lock()
	defer inf.mu.Unlock()
	if !inf.refreshing[id] && inf.intake.Submit(id, refresh{}) == nil {
		inf.refreshing[id] = true
	}
}

// Stats returns the informer's counters.
func (inf *Informer[T]) Stats() InformerStats {
	inf.mu.RLock()
	defer inf.mu.RUnlock()
	s := inf.stats
	s.Objects = len(inf.objects)
	s.Resubscribed = inf.intake.Stats().Resubscribed
	return s
}

// Monitor is the monitor that delivers changes, for its Stats and metrics.
func (inf *Informer[T]) Monitor() *eventmonitor.Monitor { return inf.deliver }

// observation is an object as a listing (relist) or a read showed it; obj
// nil: there was none.
type observation[T any] struct {
	obj    *T
	at     time.Time // when the listing or read began
	relist *round    // nil for a read
}

// refresh asks for a read of the object.
type refresh struct{}

// round is one relist's observations, done once all are applied.
type round struct {
	mu       sync.Mutex
	left     int
	at       time.Time
	corrects uint64
}

// relist lists every object and queues what it found for each, and for
// each cached object it did not find. It is the intake's resync hook, so
// it runs on every (re)subscription.
func (inf *Informer[T]) relist(ctx context.Context) error {
	inf.relisting.Lock()
	defer inf.relisting.Unlock()
	at := inf.cfg.clock.Now()
	listCtx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	listed, err := inf.kind.list(listCtx)
	if err != nil {
		return fmt.Errorf("containerd: list %ss: %w", inf.kind.noun(), err)
	}
	inf.mu.RLock()
	ids := slices.Collect(maps.Keys(listed))
	for id := range inf.objects {
		if _, ok := listed[id]; !ok {
			ids = append(ids, id)
		}
	}
	inf.mu.RUnlock()
	r := &round{left: len(ids) + 1, at: at}
	for _, id := range ids {
		if inf.intake.Submit(id, observation[T]{obj: listed[id], at: at, relist: r}) != nil {
			return nil // stopping
		}
	}
	inf.roundDone(r, 0) // the +1: no empty round is done before it began
	return nil
}

// roundDone counts one of r's observations applied, with its corrections,
// and ends the round with the last.
func (inf *Informer[T]) roundDone(r *round, corrections uint64) {
	r.mu.Lock()
	r.left--
	r.corrects += corrections
	last := r.left == 0
	r.mu.Unlock()
	if !last {
		return
	}
	inf.mu.Lock()
	defer inf.mu.Unlock()
	inf.stats.Relists++
	inf.stats.LastRelist = inf.cfg.clock.Since(r.at)
	if r.at.After(inf.floor) {
		inf.floor = r.at
		for id, at := range inf.gone {
			if at.Before(r.at) { // the listing did not show it either
				delete(inf.gone, id)
			}
		}
	}
	first := !inf.HasSynced()
	if first {
		close(inf.synced)
	}
	inf.cfg.logger.WithFields(log.Fields{"informer": inf.kind.noun(), "objects": len(inf.objects),
		"corrections": r.corrects, "took": inf.stats.LastRelist, "first": first}).Debug("containerd: relist applied")
}

// apply is the intake's handler: it applies one event, listing or read to
// its object's cache entry and queues the changes for the handler.
func (inf *Informer[T]) apply(ctx context.Context, input any) error {
	id := eventmonitor.KeyFromContext(ctx)
	switch in := input.(type) {
	case observation[T]:
		n := inf.observe(id, in)
		if in.relist != nil {
			inf.roundDone(in.relist, n)
		}
		return nil
	case refresh:
		inf.mu.Lock()
		delete(inf.refreshing, id) // a Resync from now on reads again
		inf.stats.Refreshes++
		inf.mu.Unlock()
		at := inf.cfg.clock.Now()
		obj, err := inf.kind.read(ctx, id)
		if err != nil {
			return fmt.Errorf("containerd: read %s %s: %w", inf.kind.noun(), id, err)
		}
		inf.observe(id, observation[T]{obj: obj, at: at})
		return nil
	}
	event := input
	at, fromStream := eventmonitor.TimestampFromContext(ctx)
	switch in, own := input.(stamped); {
	case own: // news of the kind's own, such as an exit wait's
		event, at = in.event, in.at
	case !fromStream:
		at = inf.cfg.clock.Now()
	}
	cur, version := inf.lookup(id)
	if at.Before(version) && !inf.kind.additive(event) {
		return nil // a listing or an event newer than this one was applied
	}
	states, again, err := inf.kind.apply(ctx, id, cur, event, at)
	if err != nil {
		return err
	}
	if again {
		inf.Resync(id)
	}
	if version.After(at) { // an additive event older than the newest news
		at = version
	}
	inf.commit(id, states, at, false)
	return nil
}

// observe applies an observation, returning how many changes it made. One
// older than news already applied is skipped, and, for a relist's, the
// object is read again: the listing may hold something the news did not.
func (inf *Informer[T]) observe(id string, o observation[T]) (changes uint64) {
	cur, version := inf.lookup(id)
	if o.at.Before(version) {
		if o.relist != nil {
			inf.Resync(id)
		}
		return 0
	}
	return inf.commit(id, inf.kind.reconcile(id, cur, o.obj), o.at, true)
}

// lookup returns the cached object with id (nil if none) and when its
// newest news began.
func (inf *Informer[T]) lookup(id string) (*T, time.Time) {
	inf.mu.RLock()
	defer inf.mu.RUnlock()
	if c, ok := inf.objects[id]; ok {
		return c.obj, c.version
	}
	if at, ok := inf.gone[id]; ok {
		return nil, at
	}
	return nil, inf.floor
}

// commit moves id's cache entry through states (nil: gone), queueing a
// change for each step, and returns how many. listed: a listing or read
// found them, so once synced they are corrections.
func (inf *Informer[T]) commit(id string, states []*T, at time.Time, listed bool) (changes uint64) {
	inf.mu.Lock()
	defer inf.mu.Unlock()
	prev := inf.objects[id].obj
	for _, next := range states {
		if inf.kind.equal(prev, next) {
			continue
		}
		if err := inf.deliver.Submit(id, Change[T]{Old: prev, New: next}); err != nil {
			inf.cfg.logger.WithError(err).WithField("id", id).Debug("containerd: change not delivered")
		}
		prev = next
		changes++
	}
	if listed && inf.HasSynced() {
		inf.stats.Corrections += changes
	}
	if prev == nil {
		delete(inf.objects, id)
		inf.gone[id] = at
	} else {
		inf.objects[id] = cached[T]{obj: prev, version: at}
		delete(inf.gone, id)
	}
	if r, ok := inf.kind.(runner[T]); ok && changes > 0 {
		r.settled(id, prev)
	}
	return changes
}

// stamped is news of a kind's own with the time it began.
type stamped struct {
	event any
	at    time.Time
}
