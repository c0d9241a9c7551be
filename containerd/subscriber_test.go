package containerd_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/eventmonitor/eventmonitor/containerd"
)

// oneEvent is containerd's events service delivering one envelope to each
// subscriber.
type oneEvent struct {
	eventsapi.UnimplementedEventsServer
}

func (oneEvent) Subscribe(_ *eventsapi.SubscribeRequest, stream eventsapi.Events_SubscribeServer) error {
	if err := stream.Send(&eventsapi.Envelope{Topic: "/x"}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

// TestSubscribeRightAfterTheDaemonIsBack subscribes once, over a
// connection whose last attempt failed, right after a daemon is listening
// again. Waking the connection's reconnection alone is not enough: until
// the new attempt succeeds, gRPC fails calls at once with the error of the
// attempt before, and Run would wait a whole resubscribe delay for nothing.
// The subscription must come through the first time.
func TestSubscribeRightAfterTheDaemonIsBack(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "ems")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "events.sock")
	// A plain connection, whose reconnect backoff is gRPC's default (1 s
	// and more): without the wake, its next attempt would come too late.
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	sub := containerd.NewSubscriber(conn)

	// Nobody listens: the subscription fails and the connection with it.
	ctx, cancel := context.WithCancel(context.Background())
	_, errs := sub.Subscribe(ctx)
	require.Error(t, <-errs)
	cancel()
	// gRPC may already be connecting again (TransientFailure or Connecting,
	// by its own timing): what matters is that it is not ready.
	require.NotEqual(t, connectivity.Ready, conn.GetState())

	l, err := net.Listen("unix", socket)
	require.NoError(t, err)
	srv := grpc.NewServer()
	eventsapi.RegisterEventsServer(srv, oneEvent{})
	go srv.Serve(l)
	t.Cleanup(srv.Stop)

	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	ch, errs := sub.Subscribe(ctx)
	select {
	case env := <-ch:
		require.NotNil(t, env)
		require.Equal(t, "/x", env.Topic)
	case err := <-errs:
		t.Fatalf("the first subscription after the daemon was back failed: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no envelope within 10 s")
	}
}
