// Package fakecontainerd is an in-process containerd for unit tests: its
// Events, Containers, Tasks and Images gRPC services over records and an
// event stream the test controls, with knobs for a real daemon's races and
// faults. By default a change publishes the events containerd would.
package fakecontainerd

import (
	"context"
	"fmt"
	"net"
	"regexp"
	"sync"
	"testing"
	"time"

	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/utils/clock"
)

// The full names of the methods served, for Calls and OnCall.
const (
	EventsPublish        = "/containerd.services.events.v1.Events/Publish"
	EventsSubscribe      = "/containerd.services.events.v1.Events/Subscribe"
	ContainersList       = "/containerd.services.containers.v1.Containers/List"
	ContainersListStream = "/containerd.services.containers.v1.Containers/ListStream"
	ContainersGet        = "/containerd.services.containers.v1.Containers/Get"
	TasksList            = "/containerd.services.tasks.v1.Tasks/List"
	TasksGet             = "/containerd.services.tasks.v1.Tasks/Get"
	TasksWait            = "/containerd.services.tasks.v1.Tasks/Wait"
	ImagesList           = "/containerd.services.images.v1.Images/List"
	ImagesGet            = "/containerd.services.images.v1.Images/Get"
)

// Fake is one fake daemon; its methods may be called from any goroutine,
// OnCall hooks included.
type Fake struct {
	t           testing.TB
	clock       clock.PassiveClock
	containerID bool
	conn        *grpc.ClientConn

	mu      sync.Mutex
	live    map[string]*nsState
	stale   *Snapshot // what List and Get serve instead of live, if set
	subs    map[*subscription]bool
	down    bool
	alive   chan struct{} // closed by Down, replaced by Up
	changed chan struct{} // closed and replaced on every change
	calls   map[string]int
	hooks   map[string]func(call int)
}

// Option configures New.
type Option func(*Fake)

// WithClock makes c the source of every timestamp (default: the real time).
func WithClock(c clock.PassiveClock) Option { return func(f *Fake) { f.clock = c } }

// WithTaskContainerID fills Process.ContainerID in Tasks.List and Get,
// which no containerd release does (only ID, the container's, is set).
func WithTaskContainerID() Option { return func(f *Fake) { f.containerID = true } }

// New starts a fake daemon, stopped when t ends.
func New(t testing.TB, opts ...Option) *Fake {
	f := &Fake{
		t: t, clock: clock.RealClock{}, live: map[string]*nsState{}, subs: map[*subscription]bool{},
		alive: make(chan struct{}), changed: make(chan struct{}), calls: map[string]int{}, hooks: map[string]func(int){},
	}
	for _, o := range opts {
		o(f)
	}
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(grpc.UnaryInterceptor(f.unary), grpc.StreamInterceptor(f.stream), grpc.WaitForHandlers(true))
	f.register(srv)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	conn, err := grpc.NewClient("passthrough:///fakecontainerd", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatalf("fakecontainerd: %v", err)
	}
	f.conn = conn
	t.Cleanup(func() {
		conn.Close()
		srv.Stop() // with WaitForHandlers, once every handler has returned
		<-served
	})
	return f
}

// Conn is a client connection to the fake, closed when the test ends.
func (f *Fake) Conn() *grpc.ClientConn { return f.conn }

var validNamespace = regexp.MustCompile(`^[A-Za-z0-9]+(?:[._-](?:[A-Za-z0-9]+))*$`)

// Namespace returns the namespace called name, created by its first change.
func (f *Fake) Namespace(name string) Namespace {
	if !validNamespace.MatchString(name) {
		f.t.Errorf("fakecontainerd: invalid namespace %q", name)
	}
	return Namespace{f: f, name: name}
}

// Deliver publishes envs as they are, changing nothing: events a Quiet
// change returned, late, reordered or twice, or envelopes of one's own.
func (f *Fake) Deliver(envs ...*types.Envelope) {
	f.locked(func() {
		for _, env := range envs {
			f.publishLocked(proto.CloneOf(env))
		}
	})
}

// Down makes the daemon unavailable, as if killed: open event streams and
// Waits fail with codes.Unavailable, and so does every call until Up.
// Events published meanwhile are lost; to deliver them late, see Quiet.
func (f *Fake) Down() {
	f.locked(func() {
		if !f.down {
			f.down = true
			close(f.alive)
			clear(f.subs) // at once, so that WaitSubscribers counts new ones only
			f.notifyLocked()
		}
	})
}

// Up ends an outage; the records are as the changes made them meanwhile.
func (f *Fake) Up() {
	f.locked(func() {
		if f.down {
			f.down, f.alive = false, make(chan struct{})
			f.notifyLocked()
		}
	})
}

// Calls returns how many calls of method (such as TasksGet) have come,
// those refused by an outage included.
func (f *Fake) Calls(method string) (n int) {
	f.locked(func() { n = f.calls[method] })
	return n
}

// OnCall makes every call of method run fn(call), call counting from 1,
// once it has read the records and before it replies (Subscribe: once it
// is registered); nil removes it. fn may change records or publish.
func (f *Fake) OnCall(method string, fn func(call int)) {
	f.locked(func() { f.hooks[method] = fn })
}

// WaitSubscribers waits until at least n event subscriptions are open, so
// that what is published next reaches them, or fails when ctx ends.
func (f *Fake) WaitSubscribers(ctx context.Context, n int) error {
	return f.waitFor(ctx, nil, func() bool { return len(f.subs) >= n })
}

// Snapshot is the records of every namespace at one moment.
type Snapshot struct{ ns map[string]*nsState }

// Snapshot returns the records as they are now, for ServeSnapshot.
func (f *Fake) Snapshot() *Snapshot {
	s := &Snapshot{ns: map[string]*nsState{}}
	f.locked(func() {
		for name, st := range f.live {
			s.ns[name] = st.clone()
		}
	})
	return s
}

// ServeSnapshot makes every List and Get answer from s, a stale view, until
// ServeSnapshot(nil); Wait and the event stream stay live.
func (f *Fake) ServeSnapshot(s *Snapshot) { f.locked(func() { f.stale = s }) }

// locked runs fn with f.mu held.
func (f *Fake) locked(fn func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn()
}

var emptyState = newState()

// state returns ns's live records, or those List and Get serve; never nil,
// not to be changed. f.mu is held.
func (f *Fake) state(ns string, live bool) *nsState {
	m := f.live
	if !live && f.stale != nil {
		m = f.stale.ns
	}
	if s := m[ns]; s != nil {
		return s
	}
	return emptyState
}

func (f *Fake) notifyLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

// waitFor waits until cond, called with f.mu held, holds, or ctx ends, or
// alive (if not nil) is closed.
func (f *Fake) waitFor(ctx context.Context, alive <-chan struct{}, cond func() bool) error {
	for {
		f.mu.Lock()
		ok, changed := cond(), f.changed
		f.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-changed:
		case <-alive:
			return errDown
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

var errDown = status.Error(codes.Unavailable, "fakecontainerd: daemon down")

// subscription is an open event stream. Its buffer stands for containerd's
// unbounded queue, so that publishing never waits for a reader.
type subscription struct {
	filter filter
	events chan *types.Envelope
}

const subscriptionBuffer = 4096

// publishLocked queues env for every subscription it matches. f.mu is held.
func (f *Fake) publishLocked(env *types.Envelope) {
	for sub := range f.subs {
		if !sub.filter.match(envelopeFields(env)) {
			continue
		}
		select {
		case sub.events <- env:
		default:
			f.t.Errorf("fakecontainerd: a subscriber has not read %d events: dropping %s", subscriptionBuffer, env.GetTopic())
		}
	}
}

// subscribe serves Events.Subscribe: events of every namespace that match
// any of the request's filters, as containerd's.
func (f *Fake) subscribe(req *eventsapi.SubscribeRequest, srv eventsapi.Events_SubscribeServer) error {
	flt, err := parseFilters(req.GetFilters())
	if err != nil { // containerd gives this error no code: clients see Unknown
		return fmt.Errorf("subscription error: failed parsing subscription filters: %w", err)
	}
	sub := &subscription{filter: flt, events: make(chan *types.Envelope, subscriptionBuffer)}
	var alive chan struct{}
	f.locked(func() {
		if !f.down {
			f.subs[sub], alive = true, f.alive
			f.notifyLocked()
		}
	})
	if alive == nil {
		return errDown
	}
	defer f.locked(func() {
		delete(f.subs, sub)
		f.notifyLocked()
	})
	f.hook(srv.Context())
	for {
		select {
		case env := <-sub.events:
			select {
			case <-alive: // nothing queued goes out once Down has returned
				return errDown
			default:
			}
			if err := srv.Send(env); err != nil {
				return err
			}
		case <-alive:
			return errDown
		case <-srv.Context().Done():
			return nil
		}
	}
}

// unary and stream count calls and refuse them during an outage. The call
// goes in the context, for the hook, which unary calls run after replying
// and streams where they say.
func (f *Fake) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	ctx, err := f.enter(ctx, info.FullMethod)
	if err != nil {
		return nil, err
	}
	resp, err := handler(ctx, req)
	f.hook(ctx)
	return resp, err
}

func (f *Fake) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	ctx, err := f.enter(ss.Context(), info.FullMethod)
	if err != nil {
		return err
	}
	return handler(srv, callStream{ss, ctx})
}

type callKey struct{}

type call struct {
	method string
	n      int
}

func (f *Fake) enter(ctx context.Context, method string) (context.Context, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[method]++
	if f.down {
		return nil, errDown
	}
	return context.WithValue(ctx, callKey{}, call{method, f.calls[method]}), nil
}

func (f *Fake) hook(ctx context.Context) {
	c, _ := ctx.Value(callKey{}).(call)
	var fn func(int)
	f.locked(func() { fn = f.hooks[c.method] })
	if fn != nil {
		fn(c.n)
	}
}

type callStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s callStream) Context() context.Context { return s.ctx }

func envelope(ns, topic string, at time.Time, event *anypb.Any) *types.Envelope {
	return &types.Envelope{Timestamp: timestamppb.New(at), Namespace: ns, Topic: topic, Event: event}
}

// mustAny encodes event as containerd does, its type URL its full name.
func mustAny(event proto.Message) *anypb.Any {
	a, err := typeurl.MarshalAny(event)
	if err != nil {
		panic(fmt.Sprintf("fakecontainerd: encoding %T: %v", event, err))
	}
	return typeurl.MarshalProto(a)
}
