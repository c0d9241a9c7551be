// Command testprog is the program containerdtest puts in its containers'
// root filesystem. Usage:
//
//	testprog CODE|oom [RELEASE-FILE]
//
// It exits with CODE, or with oom allocates memory until it is killed; given
// a release file, it first waits until that file exists.
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"
)

func main() {
	if len(os.Args) < 2 || len(os.Args) > 3 {
		fmt.Fprintln(os.Stderr, "usage: testprog CODE|oom [RELEASE-FILE]")
		os.Exit(2)
	}
	if len(os.Args) == 3 {
		for {
			if _, err := os.Stat(os.Args[2]); err == nil {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if os.Args[1] == "oom" {
		exhaustMemory()
	}
	code, err := strconv.Atoi(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "testprog:", err)
		os.Exit(2)
	}
	os.Exit(code)
}

// exhaustMemory keeps every page it allocates referenced and written, so that
// the process's resident memory grows until the kernel kills it.
func exhaustMemory() {
	var held [][]byte
	for {
		b := make([]byte, 1<<20)
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		held = append(held, b)
	}
}
