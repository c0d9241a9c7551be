package containerd

import (
	"context"
	"errors"
	"maps"
	"time"

	"github.com/containerd/containerd/api/events"
	imagesapi "github.com/containerd/containerd/api/services/images/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/eventmonitor/eventmonitor"
)

// Image is an image as the informer caches it: a name and the content it
// points at.
type Image struct {
	Name, Target string // Target: the digest of the manifest or index the name points at
	Labels       map[string]string
	UpdatedAt    time.Time
}

// NewImageInformer returns an informer of namespace's images over conn,
// keyed by name, which calls h with every change (see Informer). A tag is a
// new name: an added image.
func NewImageInformer(conn grpc.ClientConnInterface, namespace string,
	h func(ctx context.Context, c Change[Image]) error, opts ...InformerOption) (*Informer[Image], error) {
	if conn == nil {
		return nil, errors.New("containerd: informer with a nil connection")
	}
	k := &imageKind{images: imagesapi.NewImagesClient(conn), namespace: namespace}
	return newInformer[Image](conn, namespace, k, h, opts)
}

type imageKind struct {
	images    imagesapi.ImagesClient
	namespace string
}

func (k *imageKind) noun() string { return "image" }

func (k *imageKind) keys() []eventmonitor.TypeKey {
	return []eventmonitor.TypeKey{
		eventmonitor.KeyOf(func(e *events.ImageCreate) string { return e.Name }),
		eventmonitor.KeyOf(func(e *events.ImageUpdate) string { return e.Name }),
		eventmonitor.KeyOf(func(e *events.ImageDelete) string { return e.Name }),
	}
}

func (k *imageKind) list(ctx context.Context) (map[string]*Image, error) {
	resp, err := k.images.List(metadata.AppendToOutgoingContext(ctx, namespaceHeader, k.namespace), &imagesapi.ListImagesRequest{})
	if err != nil {
		return nil, err
	}
	out := map[string]*Image{}
	for _, im := range resp.GetImages() {
		out[im.GetName()] = imageOf(im)
	}
	return out, nil
}

func (k *imageKind) read(ctx context.Context, name string) (*Image, error) {
	ctx, cancel := rpc(ctx, k.namespace)
	defer cancel()
	resp, err := k.images.Get(ctx, &imagesapi.GetImageRequest{Name: name})
	if status.Code(err) == codes.NotFound {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return imageOf(resp.GetImage()), nil
}

func imageOf(im *imagesapi.Image) *Image {
	return &Image{Name: im.GetName(), Target: im.GetTarget().GetDigest(), Labels: im.GetLabels(),
		UpdatedAt: im.GetUpdatedAt().AsTime()}
}

// apply reads the image a create or update names, as its target is only in
// the daemon's record; one deleted meanwhile keeps what the event said.
func (k *imageKind) additive(any) bool { return false }

func (k *imageKind) apply(ctx context.Context, name string, cur *Image, event any, _ time.Time) ([]*Image, bool, error) {
	var labels map[string]string
	switch e := event.(type) {
	case *events.ImageDelete:
		return []*Image{nil}, false, nil
	case *events.ImageCreate:
		labels = e.Labels
	case *events.ImageUpdate:
		labels = e.Labels
	}
	im, err := k.read(ctx, name)
	if err != nil {
		return nil, false, err
	}
	if im == nil {
		im = &Image{Name: name, Labels: labels}
		if cur != nil {
			im.Target, im.UpdatedAt = cur.Target, cur.UpdatedAt
		}
	}
	return []*Image{im}, false, nil
}

func (k *imageKind) reconcile(_ string, cur, listed *Image) []*Image { return []*Image{listed} }

func (k *imageKind) equal(a, b *Image) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Name == b.Name && a.Target == b.Target && maps.Equal(a.Labels, b.Labels) && a.UpdatedAt.Equal(b.UpdatedAt)
}
