package main

import (
	"context"
	"sync"
	"time"

	"k8s.io/client-go/util/workqueue"

	"github.com/eventmonitor/eventmonitor"
)

// event is what every contender carries: its key, and when it was accepted
// (for the latency scenarios).
type event struct {
	key      string
	accepted time.Time
}

// handleFunc is the work each contender does per event.
type handleFunc func(ctx context.Context, e *event) error

// settings are what every contender gets, scaled equally.
type settings struct {
	workers        int
	initialBackoff time.Duration
	maxBackoff     time.Duration
	tick           time.Duration // the serial loop's scan period; containerd's is 1 s
	// callTimeout, if set, is every call's deadline: the peers make one per
	// call with context.WithTimeout, as containerd's CRI monitor does, and
	// eventmonitor uses it as its handle timeout. Unset, nobody gives a
	// deadline: eventmonitor runs with WithHandleTimeout(0).
	callTimeout time.Duration
}

// peerCalls returns h as a peer calls it: with a fresh context.WithTimeout
// per call if s asks for deadlines, else with a context that never ends.
func peerCalls(h handleFunc, s settings) func(*event) error {
	if s.callTimeout == 0 {
		return func(e *event) error { return h(context.Background(), e) }
	}
	return func(e *event) error {
		ctx, cancel := context.WithTimeout(context.Background(), s.callTimeout)
		defer cancel()
		return h(ctx, e)
	}
}

// contender is one way to turn events into ordered, per-key handling with
// backoff, written as its users write it.
type contender interface {
	submit(e *event)
	// backoff puts each event straight into its key's backoff queue;
	// forget takes the keys out again.
	backoff(es []*event)
	forget(keys []string)
	stop()
}

type newContender func(h handleFunc, s settings) contender

// ---- eventmonitor ----

type monitorContender struct{ m *eventmonitor.Monitor }

func newMonitor(h handleFunc, s settings) contender {
	opts := []eventmonitor.Option{
		eventmonitor.WithWorkers(s.workers),
		eventmonitor.WithBackoff(s.initialBackoff, s.maxBackoff),
		eventmonitor.WithDropHandler(func(eventmonitor.Drop) {}),
		eventmonitor.WithHandleTimeout(s.callTimeout),
	}
	m, err := eventmonitor.New(
		eventmonitor.HandlerFunc(func(ctx context.Context, e any) error { return h(ctx, e.(*event)) }), opts...)
	if err != nil {
		panic(err)
	}
	return &monitorContender{m: m}
}

func (c *monitorContender) submit(e *event) {
	if err := c.m.Submit(e.key, e); err != nil {
		panic(err)
	}
}
func (c *monitorContender) backoff(es []*event) {
	for _, e := range es {
		c.m.Backoff(e.key, e)
	}
}

func (c *monitorContender) forget(keys []string) {
	for _, key := range keys {
		c.m.Forget(key)
	}
}

func (c *monitorContender) stop() { c.m.Stop() }

// ---- client-go workqueue ----

// workqueueContender is how a controller author keeps per-key event order
// on client-go's workqueue: the queue holds keys (deduplicated, never two
// workers on one key), a map beside it holds each key's events in order.
// A worker takes a key and handles all its events; on a failure the rest
// stay queued and the key is re-added rate-limited.
type workqueueContender struct {
	queue workqueue.TypedRateLimitingInterface[string]
	mu    sync.Mutex
	fifo  map[string][]*event
	h     func(*event) error
	wg    sync.WaitGroup
}

func newWorkqueue(h handleFunc, s settings) contender {
	c := &workqueueContender{
		queue: workqueue.NewTypedRateLimitingQueue(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](s.initialBackoff, s.maxBackoff)),
		fifo: map[string][]*event{},
		h:    peerCalls(h, s),
	}
	for range s.workers {
		c.wg.Add(1)
		go c.worker()
	}
	return c
}

func (c *workqueueContender) submit(e *event) {
	c.mu.Lock()
	c.fifo[e.key] = append(c.fifo[e.key], e)
	c.mu.Unlock()
	c.queue.Add(e.key)
}

func (c *workqueueContender) backoff(es []*event) {
	for _, e := range es {
		c.mu.Lock()
		c.fifo[e.key] = append(c.fifo[e.key], e)
		c.mu.Unlock()
		c.queue.AddRateLimited(e.key)
	}
}

// forget drops the keys' events and failure counts; the keys themselves
// stay in the delaying queue's heap until due: workqueue cannot cancel them.
func (c *workqueueContender) forget(keys []string) {
	for _, key := range keys {
		c.mu.Lock()
		delete(c.fifo, key)
		c.mu.Unlock()
		c.queue.Forget(key)
	}
}

func (c *workqueueContender) worker() {
	defer c.wg.Done()
	for {
		key, shutdown := c.queue.Get()
		if shutdown {
			return
		}
		c.handleKey(key)
		c.queue.Done(key)
	}
}

func (c *workqueueContender) handleKey(key string) {
	for {
		c.mu.Lock()
		events := c.fifo[key]
		if len(events) == 0 {
			delete(c.fifo, key)
			c.mu.Unlock()
			c.queue.Forget(key)
			return
		}
		e := events[0]
		c.mu.Unlock()
		if err := c.h(e); err != nil {
			c.queue.AddRateLimited(key)
			return
		}
		c.mu.Lock()
		c.fifo[key] = c.fifo[key][1:]
		c.mu.Unlock()
	}
}

func (c *workqueueContender) stop() {
	c.queue.ShutDown()
	c.wg.Wait()
}

// ---- containerd's CRI serial loop ----

// serialContender is the algorithm of containerd's CRI event monitor: one
// goroutine selects on the event channel and a ticker. An event whose key
// is in backoff joins that key's queue; otherwise it is handled inline and,
// on error, starts a queue due after the initial delay. Each tick scans
// every queue and replays the expired ones in order; the first failure
// re-queues the rest with the delay doubled up to the maximum.
type serialContender struct {
	events   chan *event
	ops      chan func()
	quit     chan struct{}
	done     chan struct{}
	h        func(*event) error
	s        settings
	backoffs map[string]*serialQueue
}

type serialQueue struct {
	events []*event
	due    time.Time
	delay  time.Duration
}

func newSerial(h handleFunc, s settings) contender {
	c := &serialContender{
		events:   make(chan *event),
		ops:      make(chan func()),
		quit:     make(chan struct{}),
		done:     make(chan struct{}),
		h:        peerCalls(h, s),
		s:        s,
		backoffs: map[string]*serialQueue{},
	}
	go c.loop()
	return c
}

func (c *serialContender) loop() {
	defer close(c.done)
	ticker := time.NewTicker(c.s.tick)
	defer ticker.Stop()
	for {
		select {
		case e := <-c.events:
			if q, ok := c.backoffs[e.key]; ok {
				q.events = append(q.events, e)
				continue
			}
			if err := c.h(e); err != nil {
				c.enqueue(e)
			}
		case <-ticker.C:
			now := time.Now()
			for key, q := range c.backoffs {
				if q.due.After(now) {
					continue
				}
				delete(c.backoffs, key)
				for i, e := range q.events {
					if err := c.h(e); err != nil {
						delay := min(2*q.delay, c.s.maxBackoff)
						c.backoffs[key] = &serialQueue{events: q.events[i:], due: time.Now().Add(delay), delay: delay}
						break
					}
				}
			}
		case op := <-c.ops:
			op()
		case <-c.quit:
			return
		}
	}
}

func (c *serialContender) enqueue(e *event) {
	if q, ok := c.backoffs[e.key]; ok {
		q.events = append(q.events, e)
		return
	}
	c.backoffs[e.key] = &serialQueue{events: []*event{e}, due: time.Now().Add(c.s.initialBackoff), delay: c.s.initialBackoff}
}

func (c *serialContender) submit(e *event) { c.events <- e }

// backoff and forget run on the loop's goroutine, as containerd's do (its
// handlers call them), all in one hop so that only their own cost counts.
func (c *serialContender) backoff(es []*event) {
	c.onLoop(func() {
		for _, e := range es {
			c.enqueue(e)
		}
	})
}

func (c *serialContender) forget(keys []string) {
	c.onLoop(func() {
		for _, key := range keys {
			delete(c.backoffs, key)
		}
	})
}

func (c *serialContender) onLoop(op func()) {
	done := make(chan struct{})
	c.ops <- func() { op(); close(done) }
	<-done
}

func (c *serialContender) stop() {
	close(c.quit)
	<-c.done
}

var contenders = []struct {
	name string
	new  newContender
}{
	{"eventmonitor", newMonitor},
	{"workqueue", newWorkqueue},
	{"serial loop", newSerial},
}
