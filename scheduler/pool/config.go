package pool

import (
	"fmt"
	"time"
)

// Config tunes a Pool's breakers and health checks. The zero value means
// every default; New fills zero fields with Default's values.
type Config struct {
	// BreakerFailures is how many consecutive failed calls open a worker's
	// breaker. Default 5: enough that a few unlucky requests do not take a
	// worker out, few enough that a dead one stops receiving traffic fast.
	BreakerFailures uint32 `yaml:"breaker_failures"`
	// BreakerOpenTimeout is how long an open breaker refuses calls before
	// it lets probe calls through (half-open). Default 10s.
	BreakerOpenTimeout time.Duration `yaml:"breaker_open_timeout"`
	// BreakerHalfOpenRequests is how many probe calls a half-open breaker
	// admits at once; that many successes close it, one failure reopens it.
	// Default 1.
	BreakerHalfOpenRequests uint32 `yaml:"breaker_half_open_requests"`

	// HealthInterval is the time between two rounds of health checks.
	// Default 2s.
	HealthInterval time.Duration `yaml:"health_interval"`
	// HealthTimeout bounds one worker's check; it may not exceed
	// HealthInterval. Default 1s, or HealthInterval if that is shorter.
	HealthTimeout time.Duration `yaml:"health_timeout"`
	// UnhealthyAfter is how many consecutive failed checks mark a worker
	// unhealthy; one passing check marks it healthy again. Default 2, so a
	// single dropped probe does not flap the worker. A check that times
	// out is not counted while the worker answers calls (Worker.Answered
	// since its previous check began): a starved host times out every
	// worker's check at once, and that is not the workers' fault.
	UnhealthyAfter int `yaml:"unhealthy_after"`
	// HealthConcurrency bounds how many checks run at once. Default 16.
	HealthConcurrency int `yaml:"health_concurrency"`

	// VirtualNodes is the number of ring points per worker (see package
	// ring). Default 160.
	VirtualNodes int `yaml:"virtual_nodes"`
}

// Default returns the configuration New uses for zero fields.
func Default() Config {
	return Config{
		BreakerFailures:         5,
		BreakerOpenTimeout:      10 * time.Second,
		BreakerHalfOpenRequests: 1,
		HealthInterval:          2 * time.Second,
		HealthTimeout:           time.Second,
		UnhealthyAfter:          2,
		HealthConcurrency:       16,
		VirtualNodes:            160,
	}
}

// withDefaults returns c with its zero fields set to Default's values.
func (c Config) withDefaults() Config {
	d := Default()
	if c.BreakerFailures == 0 {
		c.BreakerFailures = d.BreakerFailures
	}
	if c.BreakerOpenTimeout == 0 {
		c.BreakerOpenTimeout = d.BreakerOpenTimeout
	}
	if c.BreakerHalfOpenRequests == 0 {
		c.BreakerHalfOpenRequests = d.BreakerHalfOpenRequests
	}
	if c.HealthInterval == 0 {
		c.HealthInterval = d.HealthInterval
	}
	if c.HealthTimeout == 0 {
		c.HealthTimeout = min(d.HealthTimeout, c.HealthInterval)
	}
	if c.UnhealthyAfter == 0 {
		c.UnhealthyAfter = d.UnhealthyAfter
	}
	if c.HealthConcurrency == 0 {
		c.HealthConcurrency = d.HealthConcurrency
	}
	if c.VirtualNodes == 0 {
		c.VirtualNodes = d.VirtualNodes
	}
	return c
}

// Validate reports the first invalid field of c, after defaults are applied
// to its zero fields, naming the field as it is spelled in configuration.
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.BreakerOpenTimeout < 0:
		return fmt.Errorf("breaker_open_timeout: must be positive, got %v", c.BreakerOpenTimeout)
	case c.HealthInterval < 0:
		return fmt.Errorf("health_interval: must be positive, got %v", c.HealthInterval)
	case c.HealthTimeout < 0:
		return fmt.Errorf("health_timeout: must be positive, got %v", c.HealthTimeout)
	case c.HealthTimeout > c.HealthInterval:
		return fmt.Errorf("health_timeout: must not exceed health_interval (%v), got %v", c.HealthInterval, c.HealthTimeout)
	case c.UnhealthyAfter < 0:
		return fmt.Errorf("unhealthy_after: must be at least 1, got %d", c.UnhealthyAfter)
	case c.HealthConcurrency < 0:
		return fmt.Errorf("health_concurrency: must be at least 1, got %d", c.HealthConcurrency)
	case c.VirtualNodes < 0:
		return fmt.Errorf("virtual_nodes: must be at least 1, got %d", c.VirtualNodes)
	}
	return nil
}
