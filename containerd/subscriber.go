package containerd

import (
	"context"
	"errors"
	"fmt"
	"time"

	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/eventmonitor/eventmonitor"
)

// DefaultDialTimeout bounds Dial when its ctx has no deadline, as
// containerd's own client does.
const DefaultDialTimeout = 10 * time.Second

// Dial connects to containerd's gRPC socket at address, a unix socket path
// such as /run/containerd/containerd.sock, and waits until the connection is
// ready or ctx ends (DefaultDialTimeout if ctx has no deadline). Close the
// connection when done.
func Dial(ctx context.Context, address string) (*grpc.ClientConn, error) {
	if address == "" {
		return nil, errors.New("containerd: empty socket address")
	}
	conn, err := grpc.NewClient("unix://"+address,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("containerd: dial %s: %w", address, err)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultDialTimeout)
		defer cancel()
	}
	conn.Connect()
	for state := conn.GetState(); state != connectivity.Ready; state = conn.GetState() {
		if !conn.WaitForStateChange(ctx, state) {
			conn.Close()
			return nil, fmt.Errorf("containerd: %s not ready (last state %s): %w", address, state, ctx.Err())
		}
	}
	return conn, nil
}

// NewSubscriber returns a Subscriber over containerd's events service on
// conn. Filters are containerd's (for example `topic~="/tasks/"` or
// `namespace==k8s.io`) and pass through to the daemon. A stream that breaks
// delivers its gRPC error on errs, then both channels close; when ctx ends
// they close without an error. Nothing outlives ctx.
func NewSubscriber(conn grpc.ClientConnInterface) eventmonitor.Subscriber {
	return &subscriber{client: eventsapi.NewEventsClient(conn)}
}

// streamBuffer is how many envelopes a subscription holds between the gRPC
// reader and the monitor.
const streamBuffer = 128

type subscriber struct {
	client eventsapi.EventsClient
}

func (s *subscriber) Subscribe(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	// A little buffer lets the reader hand over a burst without a goroutine
	// switch per event; the monitor's intake limit still bounds the rest.
	ch := make(chan *eventmonitor.Envelope, streamBuffer)
	errs := make(chan error, 1)
	go func() {
		defer close(ch)
		defer close(errs)
		if err := s.stream(ctx, filters, ch); err != nil && ctx.Err() == nil {
			errs <- err
		}
	}()
	return ch, errs
}

// stream reads one subscription into ch until it fails or ctx ends.
func (s *subscriber) stream(ctx context.Context, filters []string, ch chan<- *eventmonitor.Envelope) error {
	stream, err := s.client.Subscribe(ctx, &eventsapi.SubscribeRequest{Filters: filters})
	if err != nil {
		return fmt.Errorf("containerd: subscribe: %w", err)
	}
	for {
		msg, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("containerd: event stream: %w", err)
		}
		env := &eventmonitor.Envelope{
			Timestamp: msg.GetTimestamp().AsTime(),
			Namespace: msg.GetNamespace(),
			Topic:     msg.GetTopic(),
		}
		// A nil Any stays a nil interface, which the monitor drops with a
		// reason, rather than a typed nil it would try to decode.
		if event := msg.GetEvent(); event != nil {
			env.Event = typeurl.Any(event)
		}
		select {
		case ch <- env:
		case <-ctx.Done():
			return nil
		}
	}
}
