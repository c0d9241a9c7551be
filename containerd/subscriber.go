package containerd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"sync"
	"time"

	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/eventmonitor/eventmonitor"
)

// DefaultDialTimeout bounds Dial when its ctx has no deadline, as
// containerd's own client does.
const DefaultDialTimeout = 10 * time.Second

// reconnectBackoff paces gRPC's own reconnection to the daemon. gRPC's
// default grows towards two minutes, and after a long daemon outage it, not
// Run's WithResubscribe, would decide when the stream comes back. The socket
// is local: trying again every second at most costs nothing.
var reconnectBackoff = backoff.Config{
	BaseDelay:  100 * time.Millisecond,
	Multiplier: 1.6,
	Jitter:     0.2,
	MaxDelay:   time.Second,
}

// Dial connects to containerd's unix socket at address and waits until the
// connection is ready or ctx ends (DefaultDialTimeout without a deadline).
// It fails at once, saying why, when the socket is missing or cannot be
// opened, so retry it yourself while the daemon may still be starting. The
// connection reconnects at most a second apart after a daemon restart.
func Dial(ctx context.Context, address string) (*grpc.ClientConn, error) {
	if address == "" {
		return nil, errors.New("containerd: empty socket address")
	}
	if err := checkSocket(address); err != nil {
		return nil, err
	}
	var dialer socketDialer
	conn, err := grpc.NewClient("passthrough:///"+address,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(dialer.dial),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: reconnectBackoff, MinConnectTimeout: DefaultDialTimeout}),
	)
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
		if state == connectivity.TransientFailure {
			if err := dialer.failure(); err != nil {
				conn.Close()
				return nil, fmt.Errorf("containerd: cannot open socket %s: %w", address, err)
			}
		}
		if !conn.WaitForStateChange(ctx, state) {
			conn.Close()
			return nil, fmt.Errorf("containerd: %s not ready (last state %s): %w", address, state, ctx.Err())
		}
	}
	return conn, nil
}

// checkSocket tells a missing socket or a path that is not one from a
// daemon that is slow to answer, before gRPC retries in silence.
func checkSocket(path string) error {
	info, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("containerd: no socket at %s (is containerd running, with this address?): %w", path, err)
	case err != nil:
		return fmt.Errorf("containerd: socket %s: %w", path, err)
	case info.Mode().Type() != fs.ModeSocket:
		return fmt.Errorf("containerd: %s is not a socket (%s)", path, fileKind(info.Mode()))
	}
	return nil
}

func fileKind(mode fs.FileMode) string {
	if mode.IsDir() {
		return "a directory"
	}
	if mode.IsRegular() {
		return "a regular file"
	}
	return "mode " + mode.Type().String()
}

// socketDialer opens the unix socket for gRPC and remembers why the last
// attempt failed, which gRPC itself only reports as TRANSIENT_FAILURE.
type socketDialer struct {
	mu      sync.Mutex
	lastErr error
}

func (d *socketDialer) dial(ctx context.Context, path string) (net.Conn, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
	d.mu.Lock()
	d.lastErr = err
	d.mu.Unlock()
	return conn, err
}

func (d *socketDialer) failure() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lastErr
}

// NewSubscriber returns a Subscriber over containerd's events service on
// conn; filters (see Filters) pass through to the daemon. Subscribe returns
// once the stream is open or refused, or after 400 ms. On a
// *grpc.ClientConn it first wakes the connection's reconnection, so that
// the stream comes back after a daemon restart when Run re-subscribes, not
// when gRPC's reconnect backoff next tries.
func NewSubscriber(conn grpc.ClientConnInterface) eventmonitor.Subscriber {
	s := &subscriber{client: eventsapi.NewEventsClient(conn)}
	s.conn, _ = conn.(wakeable)
	return s
}

// wakeable is what wakeConnection needs of a connection; *grpc.ClientConn
// has it.
type wakeable interface {
	ResetConnectBackoff()
	GetState() connectivity.State
	WaitForStateChange(ctx context.Context, state connectivity.State) bool
}

// connectWait bounds how long wakeConnection waits for a connection to
// come up: a local socket connects in milliseconds when the daemon is up.
// openWait bounds how long Subscribe waits for the stream: a daemon that
// accepts the socket but does not answer would hold it for gRPC's connect
// timeout (20 s).
const (
	connectWait = 200 * time.Millisecond
	openWait    = 2 * connectWait
)

// wakeConnection makes conn try to connect now, and waits (at most
// connectWait) while it is trying. Resetting the backoff only starts an
// attempt: until it succeeds, gRPC fails a call at once with the error of
// the attempt before, so that a call made right after the reset would fail
// although the daemon is back, and wait a whole retry delay for nothing.
func wakeConnection(ctx context.Context, conn wakeable) {
	if conn == nil {
		return
	}
	conn.ResetConnectBackoff()
	ctx, cancel := context.WithTimeout(ctx, connectWait)
	defer cancel()
	for state := conn.GetState(); state == connectivity.TransientFailure || state == connectivity.Connecting; state = conn.GetState() {
		if !conn.WaitForStateChange(ctx, state) {
			return
		}
	}
}

// streamBuffer is how many envelopes a subscription holds between the gRPC
// reader and the monitor.
const streamBuffer = 128

type subscriber struct {
	client eventsapi.EventsClient
	conn   wakeable // nil unless the connection can be woken
}

// Subscribe waits, up to openWait, for the stream to open or be refused,
// so that a daemon still down refuses at once: Run counts a subscription
// not refused within the initial resubscribe delay as established, and
// relists (WithResync).
func (s *subscriber) Subscribe(ctx context.Context, filters ...string) (<-chan *eventmonitor.Envelope, <-chan error) {
	// A little buffer lets the reader hand over a burst without a goroutine
	// switch per event; the monitor's intake limit still bounds the rest.
	ch := make(chan *eventmonitor.Envelope, streamBuffer)
	errs := make(chan error, 1)
	opened := make(chan struct{})
	go func() {
		defer close(ch)
		defer close(errs)
		wakeConnection(ctx, s.conn)
		stream, err := s.client.Subscribe(ctx, &eventsapi.SubscribeRequest{Filters: filters})
		close(opened) // open or refused: the error follows at once
		if err != nil {
			err = fmt.Errorf("containerd: subscribe: %w", err)
		} else {
			err = read(ctx, stream, ch)
		}
		if err != nil && ctx.Err() == nil {
			errs <- err
		}
	}()
	wait := time.NewTimer(openWait)
	defer wait.Stop()
	select {
	case <-opened:
	case <-wait.C:
	case <-ctx.Done():
	}
	return ch, errs
}

// read reads one subscription's stream into ch until it fails or ctx ends.
func read(ctx context.Context, stream eventsapi.Events_SubscribeClient, ch chan<- *eventmonitor.Envelope) error {
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
