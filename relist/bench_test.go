package relist

import (
	"context"
	"fmt"
	"math/rand/v2"
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

// BenchmarkRelistUnchanged: 10,000 pods × 5 containers, nothing changed,
// listed in the same order every time (ordered) or with every pod's
// containers in a new order every relist, as containerd's CRI lists them
// (shuffled). Reports ns and allocations per container beyond the listing
// itself.
func BenchmarkRelistUnchanged(b *testing.B) {
	const pods, containers = 10000, 5
	for _, shuffled := range []bool{false, true} {
		name := "ordered"
		listings := [][]Pod{listing(pods, containers)}
		if shuffled {
			name = "shuffled"
			rng := rand.New(rand.NewPCG(1, 2))
			for range 7 { // prepared beforehand: the benchmark times relisting, not shuffling
				pl := listing(pods, containers)
				for _, p := range pl {
					rng.Shuffle(len(p.Containers), func(i, j int) { p.Containers[i], p.Containers[j] = p.Containers[j], p.Containers[i] })
				}
				listings = append(listings, pl)
			}
		}
		b.Run(name, func(b *testing.B) {
			next := 0
			r := New(func(context.Context) ([]Pod, error) {
				next++
				return listings[next%len(listings)], nil
			}, func(context.Context, Event) error { return nil })
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
		})
	}
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
