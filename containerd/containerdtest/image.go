package containerdtest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"
)

// The media types of an OCI image, as the image spec names them.
const (
	mediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
	mediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	mediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"
)

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// WriteImage writes to w an OCI image layout archive, as ctr images import
// reads it, of one image named ref (a full reference such as
// "docker.io/library/test:1") whose single layer holds [Daemon.Rootfs]'s
// test program, for this machine's platform.
func (d *Daemon) WriteImage(w io.Writer, ref string) error {
	rootfs, err := d.Rootfs()
	if err != nil {
		return err
	}
	program, err := os.ReadFile(filepath.Join(rootfs, "testprog"))
	if err != nil {
		return err
	}
	var layer bytes.Buffer
	lw := tar.NewWriter(&layer)
	epoch := time.Unix(0, 0)
	for _, h := range []*tar.Header{
		{Typeflag: tar.TypeDir, Name: "release/", Mode: 0o755, ModTime: epoch},
		{Typeflag: tar.TypeReg, Name: "testprog", Mode: 0o755, ModTime: epoch, Size: int64(len(program))},
	} {
		if err := lw.WriteHeader(h); err != nil {
			return err
		}
	}
	lw.Write(program)
	if err := lw.Close(); err != nil {
		return err
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(layer.Bytes())
	if err := zw.Close(); err != nil {
		return err
	}

	blobs := map[string][]byte{}
	add := func(mediaType string, b []byte) descriptor {
		sum := sha256.Sum256(b)
		dgst := "sha256:" + hex.EncodeToString(sum[:])
		blobs[dgst] = b
		return descriptor{MediaType: mediaType, Digest: dgst, Size: int64(len(b))}
	}
	diffID := sha256.Sum256(layer.Bytes())
	config, _ := json.Marshal(map[string]any{
		"created":      epoch.UTC().Format(time.RFC3339),
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config":       map[string]any{"Cmd": Process{}.Args()},
		"rootfs": map[string]any{
			"type":     "layers",
			"diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])},
		},
	})
	manifest, _ := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaTypeManifest,
		"config":        add(mediaTypeConfig, config),
		"layers":        []descriptor{add(mediaTypeLayer, gz.Bytes())},
	})
	m := add(mediaTypeManifest, manifest)
	// containerd names an imported image by its own annotation, in full; the
	// OCI one holds only the tag.
	m.Annotations = map[string]string{
		"io.containerd.image.name":          ref,
		"org.opencontainers.image.ref.name": tagOf(ref),
	}
	index, _ := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaTypeIndex,
		"manifests":     []descriptor{m},
	})

	tw := tar.NewWriter(w)
	file := func(name string, b []byte) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, ModTime: epoch, Size: int64(len(b))}); err != nil {
			return err
		}
		_, err := tw.Write(b)
		return err
	}
	if err := file("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := file("index.json", index); err != nil {
		return err
	}
	for _, dgst := range slices.Sorted(maps.Keys(blobs)) {
		if err := file("blobs/sha256/"+strings.TrimPrefix(dgst, "sha256:"), blobs[dgst]); err != nil {
			return err
		}
	}
	return tw.Close()
}

// tagOf is ref's tag, or "latest".
func tagOf(ref string) string {
	name := ref[strings.LastIndexByte(ref, '/')+1:]
	name, _, _ = strings.Cut(name, "@")
	if _, tag, ok := strings.Cut(name, ":"); ok {
		return tag
	}
	return "latest"
}

// ImportImage imports the image of [Daemon.WriteImage], named ref, into
// namespace ns, unpacked for [Daemon.RunImage].
func (d *Daemon) ImportImage(ns, ref string) error {
	f, err := os.CreateTemp(d.dir, "image-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	err = d.WriteImage(f, ref)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		_, err = d.Ctr("-n", ns, "images", "import", f.Name())
	}
	return err
}

// TagImage gives image src in namespace ns the new name dst.
func (d *Daemon) TagImage(ns, src, dst string) error {
	_, err := d.Ctr("-n", ns, "images", "tag", src, dst)
	return err
}

// RemoveImage removes the image named ref from namespace ns.
func (d *Daemon) RemoveImage(ns, ref string) error {
	_, err := d.Ctr("-n", ns, "images", "rm", ref)
	return err
}
