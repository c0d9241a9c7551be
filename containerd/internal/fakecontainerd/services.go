package fakecontainerd

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"strings"

	containersapi "github.com/containerd/containerd/api/services/containers/v1"
	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	imagesapi "github.com/containerd/containerd/api/services/images/v1"
	tasksapi "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/api/types/task"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// One type per service, their method names clashing; the Unimplemented
// servers answer the methods not served with codes.Unimplemented.
type (
	eventsServer struct {
		eventsapi.UnimplementedEventsServer
		f *Fake
	}
	containersServer struct {
		containersapi.UnimplementedContainersServer
		f *Fake
	}
	tasksServer struct {
		tasksapi.UnimplementedTasksServer
		f *Fake
	}
	imagesServer struct {
		imagesapi.UnimplementedImagesServer
		f *Fake
	}
)

func (f *Fake) register(srv *grpc.Server) {
	eventsapi.RegisterEventsServer(srv, eventsServer{f: f})
	containersapi.RegisterContainersServer(srv, containersServer{f: f})
	tasksapi.RegisterTasksServer(srv, tasksServer{f: f})
	imagesapi.RegisterImagesServer(srv, imagesServer{f: f})
}

// namespaceOf reads the namespace from the first containerd-namespace
// header, with containerd's errors; all but Subscribe require one.
func namespaceOf(ctx context.Context) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	switch v := md.Get("containerd-namespace"); {
	case len(v) == 0 || v[0] == "":
		return "", status.Error(codes.FailedPrecondition, "namespace is required: failed precondition")
	case !validNamespace.MatchString(v[0]):
		return "", status.Errorf(codes.InvalidArgument, "namespace validation: identifier %q must match %v: invalid argument", v[0], validNamespace)
	default:
		return v[0], nil
	}
}

// serve runs fn on the records that List and Get serve for ctx's namespace.
func (f *Fake) serve(ctx context.Context, fn func(ns string, s *nsState) error) (err error) {
	ns, err := namespaceOf(ctx)
	if err == nil {
		f.locked(func() { err = fn(ns, f.state(ns, false)) })
	}
	return err
}

func (s eventsServer) Subscribe(req *eventsapi.SubscribeRequest, srv eventsapi.Events_SubscribeServer) error {
	return s.f.subscribe(req, srv)
}

func (s eventsServer) Publish(ctx context.Context, req *eventsapi.PublishRequest) (*emptypb.Empty, error) {
	ns, err := namespaceOf(ctx)
	if err != nil {
		return nil, status.Error(status.Code(err), "failed publishing event: "+status.Convert(err).Message())
	}
	if t := req.GetTopic(); len(t) < 2 || t[0] != '/' {
		return nil, status.Errorf(codes.InvalidArgument, "envelope topic %q: invalid argument", t)
	}
	s.f.locked(func() { s.f.publishLocked(envelope(ns, req.GetTopic(), s.f.clock.Now(), req.GetEvent())) })
	return &emptypb.Empty{}, nil
}

func (s containersServer) List(ctx context.Context, req *containersapi.ListContainersRequest) (*containersapi.ListContainersResponse, error) {
	cs, err := s.list(ctx, req)
	return &containersapi.ListContainersResponse{Containers: cs}, err
}

// ListStream is what containerd's own client lists containers with.
func (s containersServer) ListStream(req *containersapi.ListContainersRequest, srv containersapi.Containers_ListStreamServer) error {
	cs, err := s.list(srv.Context(), req)
	s.f.hook(srv.Context())
	for _, c := range cs {
		if err := srv.Send(&containersapi.ListContainerMessage{Container: c}); err != nil {
			return err
		}
	}
	return err
}

func (s containersServer) list(ctx context.Context, req *containersapi.ListContainersRequest) (out []*containersapi.Container, err error) {
	flt, err := parseFilters(req.GetFilters())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return out, s.f.serve(ctx, func(_ string, st *nsState) error {
		for _, id := range slices.Sorted(maps.Keys(st.containers)) {
			if c := st.containers[id]; flt.match(fields(map[string]string{"id": c.ID, "image": c.Image, "runtime.name": c.Runtime}, c.Labels)) {
				out = append(out, containerProto(c))
			}
		}
		return nil
	})
}

func (s containersServer) Get(ctx context.Context, req *containersapi.GetContainerRequest) (resp *containersapi.GetContainerResponse, err error) {
	return resp, s.f.serve(ctx, func(ns string, st *nsState) error {
		c, ok := st.containers[req.GetID()]
		if !ok {
			return status.Errorf(codes.NotFound, "container %q in namespace %q: not found", req.GetID(), ns)
		}
		resp = &containersapi.GetContainerResponse{Container: containerProto(c)}
		return nil
	})
}

// List lists every task, also of a deleted container, and ignores the
// request's filter, as containerd does.
func (s tasksServer) List(ctx context.Context, _ *tasksapi.ListTasksRequest) (resp *tasksapi.ListTasksResponse, err error) {
	resp = &tasksapi.ListTasksResponse{}
	return resp, s.f.serve(ctx, func(_ string, st *nsState) error {
		for k, p := range st.procs {
			if k.exec == "" {
				resp.Tasks = append(resp.Tasks, s.f.processProto(k.container, p))
			}
		}
		slices.SortFunc(resp.Tasks, func(a, b *task.Process) int { return strings.Compare(a.ID, b.ID) })
		return nil
	})
}

func (s tasksServer) Get(ctx context.Context, req *tasksapi.GetRequest) (resp *tasksapi.GetResponse, err error) {
	return resp, s.f.serve(ctx, func(ns string, st *nsState) error {
		p, err := findProcess(ns, st, req.GetContainerID(), req.GetExecID())
		if err == nil {
			resp = &tasksapi.GetResponse{Process: s.f.processProto(req.GetContainerID(), p)}
		}
		return err
	})
}

// Wait waits on the live records, even while a Snapshot is served.
func (s tasksServer) Wait(ctx context.Context, req *tasksapi.WaitRequest) (*tasksapi.WaitResponse, error) {
	ns, err := namespaceOf(ctx)
	if err != nil {
		return nil, err
	}
	var alive chan struct{}
	s.f.locked(func() {
		if !s.f.down { // the interceptor let the call in, but Down may have come since
			alive = s.f.alive
		}
	})
	if alive == nil {
		return nil, errDown
	}
	var (
		p       Process
		missing error
	)
	err = s.f.waitFor(ctx, alive, func() bool {
		p, missing = findProcess(ns, s.f.state(ns, true), req.GetContainerID(), req.GetExecID())
		return missing != nil || p.Status == task.Status_STOPPED
	})
	if err = cmp.Or(err, missing); err != nil {
		return nil, err
	}
	return &tasksapi.WaitResponse{ExitStatus: p.ExitStatus, ExitedAt: timestamppb.New(p.ExitedAt)}, nil
}

// findProcess finds a process as containerd does: the container, its task,
// then the exec.
func findProcess(ns string, st *nsState, id, execID string) (Process, error) {
	if _, ok := st.containers[id]; !ok {
		return Process{}, status.Errorf(codes.NotFound, "container %q in namespace %q: not found", id, ns)
	} else if _, ok := st.procs[procKey{id, ""}]; !ok {
		return Process{}, status.Errorf(codes.NotFound, "task %v not found", id)
	} else if p, ok := st.procs[procKey{id, execID}]; ok {
		return p, nil
	}
	return Process{}, status.Errorf(codes.NotFound, "process does not exist %s: not found", execID)
}

func (s imagesServer) List(ctx context.Context, req *imagesapi.ListImagesRequest) (resp *imagesapi.ListImagesResponse, err error) {
	flt, err := parseFilters(req.GetFilters())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	resp = &imagesapi.ListImagesResponse{}
	return resp, s.f.serve(ctx, func(_ string, st *nsState) error {
		for _, name := range slices.Sorted(maps.Keys(st.images)) {
			img := st.images[name]
			if flt.match(fields(map[string]string{"name": img.Name, "target.digest": img.Target.Digest, "target.mediatype": img.Target.MediaType}, img.Labels)) {
				resp.Images = append(resp.Images, imageProto(img))
			}
		}
		return nil
	})
}

func (s imagesServer) Get(ctx context.Context, req *imagesapi.GetImageRequest) (resp *imagesapi.GetImageResponse, err error) {
	return resp, s.f.serve(ctx, func(_ string, st *nsState) error {
		img, ok := st.images[req.GetName()]
		if !ok {
			return status.Errorf(codes.NotFound, "image %q: not found", req.GetName())
		}
		resp = &imagesapi.GetImageResponse{Image: imageProto(img)}
		return nil
	})
}

// fields is an object's adaptor: its fields by dotted path, and labels.<key>.
func fields(byPath, labels map[string]string) adaptor {
	return func(path []string) (string, bool) {
		if len(path) > 1 && path[0] == "labels" {
			v, ok := labels[strings.Join(path[1:], ".")]
			return v, ok
		}
		v := byPath[strings.Join(path, ".")]
		return v, v != ""
	}
}

func containerProto(c Container) *containersapi.Container {
	return &containersapi.Container{
		ID: c.ID, Image: c.Image, Labels: c.Labels, Runtime: &containersapi.Container_Runtime{Name: c.Runtime},
		CreatedAt: timestamppb.New(c.CreatedAt), UpdatedAt: timestamppb.New(c.UpdatedAt),
	}
}

// processProto sets ExitedAt also for a live process, to the zero time, as
// containerd does.
func (f *Fake) processProto(containerID string, p Process) *task.Process {
	tp := &task.Process{ID: p.ID, Pid: p.Pid, Status: p.Status, ExitStatus: p.ExitStatus, ExitedAt: timestamppb.New(p.ExitedAt)}
	if f.containerID {
		tp.ContainerID = containerID
	}
	return tp
}

func imageProto(img Image) *imagesapi.Image {
	return &imagesapi.Image{
		Name: img.Name, Labels: img.Labels,
		Target:    &types.Descriptor{MediaType: img.Target.MediaType, Digest: img.Target.Digest, Size: img.Target.Size},
		CreatedAt: timestamppb.New(img.CreatedAt), UpdatedAt: timestamppb.New(img.UpdatedAt),
	}
}
