//go:build tools

// Package tools pins rclone (github.com/rclone/rclone), built by
// hack/cluster/build-gotool.sh rclone for the test suite's S3 server:
// `rclone serve s3` on loopback (tests/s3_helpers.py, hack/cluster/lc/s3.py).
// The imports are what rclone's main package imports, so `go mod tidy`
// records its dependencies; the build tag keeps this file out of every build.
package tools

import (
	_ "github.com/rclone/rclone/backend/all"
	_ "github.com/rclone/rclone/cmd"
	_ "github.com/rclone/rclone/cmd/all"
	_ "github.com/rclone/rclone/lib/plugin"
)
