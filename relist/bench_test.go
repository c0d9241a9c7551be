package relist

import (
	"context"
	"fmt"
	"testing"
	"time"
)

func listing(pods, containers int) []Pod {
	out := make([]Pod, pods)
	for i := range out {
		out[i].ID = fmt.Sprintf("pod-%d", i)
		for j := range containers {
			out[i].Containers = append(out[i].Containers, Container{ID: fmt.Sprintf("pod-%d-c%d", i, j), State: StateRunning})
		}
	}
	return out
}

// BenchmarkRelistUnchanged: 10,000 pods × 5 containers, nothing changed.
// Reports ns and allocations per container beyond the listing itself.
func BenchmarkRelistUnchanged(b *testing.B) {
	const pods, containers = 10000, 5
	pl := listing(pods, containers)
	r := New(func(context.Context) ([]Pod, error) { return pl, nil },
		func(context.Context, Event) error { return nil })
	ctx := context.Background()
	if err := r.Relist(ctx); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if err := r.Relist(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*pods*containers), "ns/container")
}

// BenchmarkRelistSlowInspect: 200 changed pods, 20 ms inspections, 4
// workers: about 200 × 20 ms / 4 = 1 s, where a serial inspection takes 4 s.
func BenchmarkRelistSlowInspect(b *testing.B) {
	const pods = 200
	for range b.N {
		pl := listing(pods, 1)
		r := New(func(context.Context) ([]Pod, error) { return pl, nil },
			func(context.Context, Event) error { return nil },
			WithInspect(func(context.Context, string, *Pod) error { time.Sleep(20 * time.Millisecond); return nil }))
		if err := r.Relist(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
}
