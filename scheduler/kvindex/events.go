package kvindex

// The index's own view of what a worker reports: package watch converts
// the workers' wire messages into these.

// Tier is where a worker holds a block.
type Tier uint8

// Tiers. TierGPU is the zero value: workers that report no tier mean it.
const (
	TierGPU Tier = iota
	TierCPU
	TierRedis
)

// CacheKind is what happened to the blocks of a CacheEvent.
type CacheKind uint8

// Cache event kinds.
const (
	// Stored: the worker holds Keys in Tier (or Redis does).
	Stored CacheKind = iota
	// Removed: the worker (or Redis) no longer holds Keys in Tier.
	Removed
	// Moved: Keys moved from From to Tier on the worker.
	Moved
)

// CacheEvent is a change to the blocks a worker holds.
type CacheEvent struct {
	Kind    CacheKind
	Tier    Tier
	From    Tier // Moved only
	HasFrom bool // From was reported
	Keys    []uint64
}

// Snapshot is everything a worker holds when its stream (re)starts.
type Snapshot struct {
	Load   Load
	Blocks []CacheEvent
}

// Event is one event of a worker's stream: a snapshot, a load report or a
// cache event, with its sequence number.
type Event struct {
	Seq      uint64
	Snapshot *Snapshot
	Load     *Load
	Cache    *CacheEvent
}

// Info is what a worker tells of itself when its stream (re)starts.
type Info struct {
	// BlockTokens is the tokens of one block; 0 means 16.
	BlockTokens int
	// Cost is its cost figures; HasCost says whether it reported any
	// (Cost is DefaultCost otherwise).
	Cost    Cost
	HasCost bool
	// RedisTier: it reads and writes the shared Redis tier.
	RedisTier bool
}
