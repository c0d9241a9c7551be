package containerd_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/containerd/api/events"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/containerd/typeurl/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/eventmonitor/eventmonitor"
	"github.com/eventmonitor/eventmonitor/containerd"
)

// Envelope has the fields of containerd's events.Envelope (in
// github.com/containerd/containerd/v2/core/events), as a source of
// containerd's shape delivers it.
type Envelope struct {
	Timestamp time.Time
	Namespace string
	Topic     string
	Event     typeurl.Any
}

// exchange is an in-process event source of containerd's shape, as its
// events exchange (the in-memory client's Subscribe) behaves: the envelope
// channel is unbuffered (or buffered, if asked) and never closed; when ctx
// ends, errs gets nil and closes; fail sends an error and closes it.
type exchange struct {
	buffer int

	mu   sync.Mutex
	subs []*exchangeSub
}

type exchangeSub struct {
	ctx     context.Context
	filters []string
	ch      chan *Envelope
	failed  chan error
	done    chan struct{} // the source's goroutine returned
}

func (x *exchange) Subscribe(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
	sub := &exchangeSub{ctx: ctx, filters: filters, ch: make(chan *Envelope, x.buffer),
		failed: make(chan error, 1), done: make(chan struct{})}
	errs := make(chan error, 1)
	go func() {
		defer close(sub.done)
		defer close(errs)
		select {
		case <-ctx.Done():
			errs <- nil // what containerd's exchange sends when ctx is cancelled
		case err := <-sub.failed:
			errs <- err
		}
	}()
	x.mu.Lock()
	x.subs = append(x.subs, sub)
	x.mu.Unlock()
	return sub.ch, errs
}

// sub is the n-th subscription (from 0), once it is made.
func (x *exchange) sub(t *testing.T, n int) *exchangeSub {
	t.Helper()
	waitFor(t, "the subscription", func() bool {
		x.mu.Lock()
		defer x.mu.Unlock()
		return len(x.subs) > n
	})
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.subs[n]
}

// send delivers env on the subscription, as the source's goroutine would.
func (s *exchangeSub) send(t *testing.T, env *Envelope) {
	t.Helper()
	select {
	case s.ch <- env:
	case <-s.ctx.Done():
		t.Fatal("the subscription ended before the envelope was taken")
	case <-time.After(10 * time.Second):
		t.Fatal("nobody took the envelope within 10 s")
	}
}

func exitEnvelope(t *testing.T, id string, code uint32) *Envelope {
	t.Helper()
	payload, err := typeurl.MarshalAnyToProto(&events.TaskExit{ContainerID: id, ID: id, ExitStatus: code})
	require.NoError(t, err)
	return &Envelope{Timestamp: time.Unix(1700000000, 0), Namespace: containerd.K8sNamespace, Topic: "/tasks/exit", Event: payload}
}

// next reads one envelope, or reports the channel closed.
func next(t *testing.T, ch <-chan *eventmonitor.Envelope) (*eventmonitor.Envelope, bool) {
	t.Helper()
	select {
	case env, ok := <-ch:
		return env, ok
	case <-time.After(10 * time.Second):
		t.Fatal("nothing on the channel within 10 s")
		return nil, false
	}
}

// TestFromSubscribe pins the bridge from containerd's subscriber shape: it
// forwards envelopes field for field and the filters as they are, ends its
// stream when ctx ends although the source never closes its channel,
// forwards the source's error after what the source had buffered, and
// leaves no goroutine behind.
func TestFromSubscribe(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	t.Run("envelopes and filters", func(t *testing.T) {
		x := &exchange{}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ch, _ := containerd.FromSubscribe(x.Subscribe).Subscribe(ctx, `topic=="/tasks/exit"`, `namespace==k8s.io`)
		sub := x.sub(t, 0)
		assert.Equal(t, []string{`topic=="/tasks/exit"`, `namespace==k8s.io`}, sub.filters)
		want := exitEnvelope(t, "c1", 3)
		sub.send(t, want)
		got, ok := next(t, ch)
		require.True(t, ok)
		assert.Equal(t, eventmonitor.Envelope(*want), *got)

		sub.send(t, &Envelope{Topic: "/x", Event: (*anypb.Any)(nil)})
		got, _ = next(t, ch)
		assert.Nil(t, got.Event, "a nil payload is a nil interface, not a typed nil")
		sub.send(t, nil)
		got, ok = next(t, ch)
		assert.True(t, ok)
		assert.Nil(t, got, "a nil envelope stays nil (the monitor drops it as invalid)")
	})

	t.Run("ctx ends, the source's channel never closes", func(t *testing.T) {
		x := &exchange{}
		ctx, cancel := context.WithCancel(context.Background())
		ch, errs := containerd.FromSubscribe(x.Subscribe).Subscribe(ctx)
		sub := x.sub(t, 0)
		cancel()
		_, ok := next(t, ch)
		assert.False(t, ok, "closed")
		err, ok := <-errs
		assert.False(t, ok, "closed without an error (the source's nil is not one): %v", err)
		<-sub.done
	})

	t.Run("the source's error", func(t *testing.T) {
		x := &exchange{}
		boom := errors.New("stream broke")
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ch, errs := containerd.FromSubscribe(x.Subscribe).Subscribe(ctx)
		sub := x.sub(t, 0)
		sub.failed <- boom
		_, ok := next(t, ch)
		assert.False(t, ok, "closed after the error")
		err := <-errs
		assert.ErrorIs(t, err, boom)
		assert.ErrorContains(t, err, "containerd: event stream: stream broke")
		_, ok = <-errs
		assert.False(t, ok, "one error, then closed")
		// The source's subscription ended with the bridge, not with ctx.
		require.Error(t, sub.ctx.Err())
	})

	t.Run("what the source buffered before its error comes first", func(t *testing.T) {
		x := &exchange{buffer: 2}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ch, errs := containerd.FromSubscribe(x.Subscribe).Subscribe(ctx)
		sub := x.sub(t, 0)
		sub.ch <- exitEnvelope(t, "c1", 1)
		sub.ch <- exitEnvelope(t, "c1", 2)
		sub.failed <- errors.New("stream broke")
		<-sub.done // the error is there before anything is read
		var topics []string
		for env := range ch {
			topics = append(topics, env.Topic)
		}
		assert.Len(t, topics, 2)
		assert.Error(t, <-errs)
	})

	t.Run("ctx ends while nobody reads", func(t *testing.T) {
		x := &exchange{buffer: 1}
		ctx, cancel := context.WithCancel(context.Background())
		_, errs := containerd.FromSubscribe(x.Subscribe).Subscribe(ctx)
		sub := x.sub(t, 0)
		sub.ch <- exitEnvelope(t, "c1", 1) // taken by the bridge, which waits to hand it over
		cancel()
		_, ok := <-errs
		assert.False(t, ok)
		<-sub.done
	})

	t.Run("a source that closes its channel", func(t *testing.T) {
		x := &exchange{}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ch, errs := containerd.FromSubscribe(x.Subscribe).Subscribe(ctx)
		sub := x.sub(t, 0)
		close(sub.ch)
		sub.failed <- errors.New("gone")
		_, ok := next(t, ch)
		assert.False(t, ok)
		assert.ErrorContains(t, <-errs, "gone")
	})

	t.Run("nil", func(t *testing.T) {
		assert.PanicsWithValue(t, "containerd: FromSubscribe with a nil subscribe function", func() {
			containerd.FromSubscribe[Envelope](nil)
		})
	})
}

// TestFromSubscribeRun runs a monitor on the bridge: events are handled,
// a source error makes Run subscribe again, and when Run's ctx ends every
// subscription has ended, although the source never closed a channel.
func TestFromSubscribeRun(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	x := &exchange{}
	h := &seen{}
	m, err := eventmonitor.New(h, eventmonitor.WithConverter(containerd.Converter()),
		eventmonitor.WithResubscribe(time.Millisecond, time.Millisecond))
	require.NoError(t, err)
	defer m.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, containerd.FromSubscribe(x.Subscribe)) }()

	x.sub(t, 0).send(t, exitEnvelope(t, "c1", 1))
	waitFor(t, "the first exit", func() bool { return len(h.of("c1")) == 1 })
	x.sub(t, 0).failed <- errors.New("stream broke")
	x.sub(t, 1).send(t, exitEnvelope(t, "c1", 2))
	waitFor(t, "the exit on the new subscription", func() bool { return len(h.of("c1")) == 2 })
	assert.Equal(t, uint64(1), m.Stats().Resubscribed)

	cancel()
	require.NoError(t, <-done)
	for i := range 2 {
		<-x.sub(t, i).done
	}
}

// remoteSubscribe has the shape and the behaviour of containerd's client
// Subscribe over its events gRPC service: an unbuffered envelope channel
// that is never closed, and the stream's error on errs, which then closes.
func remoteSubscribe(conn grpc.ClientConnInterface) func(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
	client := eventsapi.NewEventsClient(conn)
	return func(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
		ch := make(chan *Envelope)
		errs := make(chan error, 1)
		stream, err := client.Subscribe(ctx, &eventsapi.SubscribeRequest{Filters: filters})
		if err != nil {
			errs <- err
			close(errs)
			return ch, errs
		}
		go func() {
			defer close(errs)
			for {
				msg, err := stream.Recv()
				if err != nil {
					errs <- err
					return
				}
				select {
				case ch <- &Envelope{Timestamp: msg.GetTimestamp().AsTime(), Namespace: msg.GetNamespace(),
					Topic: msg.GetTopic(), Event: msg.GetEvent()}:
				case <-ctx.Done():
					return
				}
			}
		}()
		return ch, errs
	}
}

// TestFromSubscribeInDaemon reads a real containerd's events through the
// bridge over a subscriber of containerd's own shape: they are handled, and
// when the daemon goes away its error reaches Run, which subscribes again.
func TestFromSubscribeInDaemon(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, false)
	c := dial(t, d)
	h := &seen{}
	m, err := eventmonitor.New(h, eventmonitor.WithConverter(containerd.Converter()))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var subscribed atomic.Int32
	subscribe := remoteSubscribe(c.conn)
	go func() {
		done <- m.Run(ctx, containerd.FromSubscribe(func(ctx context.Context, filters ...string) (<-chan *Envelope, <-chan error) {
			subscribed.Add(1)
			return subscribe(ctx, filters...)
		}))
	}()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
		m.Stop()
	})
	c.handshake("default", h)
	require.NoError(t, c.publish(containerd.K8sNamespace, "/tasks/exit", &events.TaskExit{ContainerID: "c1", ExitStatus: 7}))
	waitFor(t, "the exit", func() bool { return len(h.of("c1")) == 1 })
	assert.Equal(t, uint32(7), h.of("c1")[0].(*events.TaskExit).ExitStatus)

	d.Stop()
	waitFor(t, "a re-subscription after the stream's error", func() bool { return subscribed.Load() > 1 })
}
