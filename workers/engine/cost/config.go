package cost

import "fmt"

// Config names an Engine by its presets, as configurations and flags do.
// The zero value of every field means its default: DefaultModel on one
// DefaultGPU at DefaultMFU and DefaultBandwidthEfficiency.
type Config struct {
	// Model is the model preset (Models). Default DefaultModel.
	Model string
	// GPU is the GPU preset (GPUs). Default DefaultGPU.
	GPU string
	// TP is the tensor-parallel degree. Default 1.
	TP int
	// MFU is the fraction of peak FLOP/s prefill reaches. Default
	// DefaultMFU.
	MFU float64
	// BandwidthEfficiency is the fraction of peak HBM bandwidth decode
	// reaches. Default DefaultBandwidthEfficiency.
	BandwidthEfficiency float64
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if c.GPU == "" {
		c.GPU = DefaultGPU
	}
	if c.TP == 0 {
		c.TP = 1
	}
	if c.MFU == 0 {
		c.MFU = DefaultMFU
	}
	if c.BandwidthEfficiency == 0 {
		c.BandwidthEfficiency = DefaultBandwidthEfficiency
	}
	return c
}

// Validate reports the first invalid field of c (defaults applied first),
// naming it. It does not check that the weights fit in memory: a caller
// that sets the KV capacity itself may not need them to; Engine.Validate
// does.
func (c Config) Validate() error {
	c = c.WithDefaults()
	switch {
	case c.TP < 1:
		return fmt.Errorf("tp: %d is below 1", c.TP)
	case c.MFU < 0 || c.MFU > 1:
		return fmt.Errorf("mfu: %v is outside (0, 1]", c.MFU)
	case c.BandwidthEfficiency < 0 || c.BandwidthEfficiency > 1:
		return fmt.Errorf("bandwidth_efficiency: %v is outside (0, 1]", c.BandwidthEfficiency)
	}
	_, err := c.Engine()
	return err
}

// Engine returns the cost model c names (defaults applied), with
// DefaultMemoryUtilization. Its error names the field of an unknown
// preset; like Validate, it does not check that the weights fit.
func (c Config) Engine() (Engine, error) {
	c = c.WithDefaults()
	m, err := LookupModel(c.Model)
	if err != nil {
		return Engine{}, fmt.Errorf("model: %w", err)
	}
	g, err := LookupGPU(c.GPU)
	if err != nil {
		return Engine{}, fmt.Errorf("gpu: %w", err)
	}
	return Engine{Model: m, GPU: g, TP: c.TP, MFU: c.MFU,
		BandwidthEfficiency: c.BandwidthEfficiency, MemoryUtilization: DefaultMemoryUtilization}, nil
}
