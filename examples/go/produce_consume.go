// Command produce_consume produces and consumes 1,000 records against a running tidelog,
// from Go with the standard gRPC library (google.golang.org/grpc).
//
// It creates a topic with 3 partitions through the Admin service (an existing topic is
// used as it is), asks Metadata for each partition's leader, produces 1,000 keyed records
// with acks=-1 to the leaders (keys are spread with Kafka's murmur2 partitioner; retriable
// per-partition errors are retried after a metadata refresh), fetches them back from every
// partition until it has all of them, and checks that every value arrived exactly once, at
// the offset its produce acknowledged.
//
// Usage:
//
//	produce_consume [ADDRESS [TOPIC]]
//
// ADDRESS is a standalone server or a broker (default: the first of $TIDELOG_BOOTSTRAP, or
// 127.0.0.1:9292); TOPIC defaults to go-example. run.sh generates the stubs (package
// tidelogv1, import path "tidelog/v1") from ../../proto and builds this file.
package main

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "tidelog/v1"
)

const (
	numRecords    = 1000
	numPartitions = 3
	callTimeout   = 15 * time.Second
	// How long produce and fetch may keep retrying before the program gives up.
	overallDeadline = 30 * time.Second
)

// Per-partition error codes worth retrying on a data path (docs/api.md marks them
// retriable). Partition errors come in the response body, without trailing metadata.
var retriablePartitionErrors = map[pb.ErrorCode]bool{
	pb.ErrorCode_UNKNOWN_TOPIC_OR_PARTITION:       true,
	pb.ErrorCode_NOT_LEADER_OR_FOLLOWER:           true,
	pb.ErrorCode_NOT_ENOUGH_REPLICAS:              true,
	pb.ErrorCode_REQUEST_TIMED_OUT:                true,
	pb.ErrorCode_NOT_ENOUGH_REPLICAS_AFTER_APPEND: true,
	pb.ErrorCode_UNKNOWN_LEADER_EPOCH:             true,
	pb.ErrorCode_KAFKA_STORAGE_ERROR:              true,
	pb.ErrorCode_NETWORK_EXCEPTION:                true,
}

// callError is a failed call: the ErrorCode name the server put in the trailing metadata
// key tidelog-error-code ("" when the failure came from the transport), and whether
// retrying may help.
type callError struct {
	code      string
	retriable bool
	err       error
}

func (e *callError) Error() string {
	if e.code == "" {
		return e.err.Error()
	}
	return e.code + ": " + status.Convert(e.err).Message()
}

func classify(err error, trailer metadata.MD) *callError {
	ce := &callError{err: err}
	if v := trailer.Get("tidelog-error-code"); len(v) > 0 {
		ce.code = v[0]
		r := trailer.Get("tidelog-retriable")
		ce.retriable = len(r) > 0 && r[0] == "true"
	} else {
		// No tidelog code: the transport failed (refused, reset, deadline).
		c := status.Code(err)
		ce.retriable = c == codes.Unavailable || c == codes.DeadlineExceeded
	}
	return ce
}

// call runs one unary RPC, retrying retriable failures with a capped exponential backoff
// until the overall deadline. fn gets the context and the call option that captures the
// trailing metadata.
func call(what string, fn func(ctx context.Context, opt grpc.CallOption) error) error {
	backoff := 50 * time.Millisecond
	deadline := time.Now().Add(overallDeadline)
	for {
		var trailer metadata.MD
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		err := fn(ctx, grpc.Trailer(&trailer))
		cancel()
		if err == nil {
			return nil
		}
		ce := classify(err, trailer)
		if !ce.retriable || time.Now().Add(backoff).After(deadline) {
			return fmt.Errorf("%s: %w", what, ce)
		}
		time.Sleep(backoff)
		if backoff *= 2; backoff > time.Second {
			backoff = time.Second
		}
	}
}

// cluster holds one connection per address and the topic's partition leaders.
type cluster struct {
	bootstrap string
	topic     string
	conns     map[string]*grpc.ClientConn
	leaders   map[uint32]string // partition -> leader's address
}

func (c *cluster) conn(address string) *grpc.ClientConn {
	if cc, ok := c.conns[address]; ok {
		return cc
	}
	// Plaintext, as tidelog serves. Newer grpc-go spells this
	// grpc.WithTransportCredentials(insecure.NewCredentials()).
	cc, err := grpc.Dial(address, grpc.WithInsecure())
	if err != nil {
		fail("connect to %s: %v", address, err)
	}
	c.conns[address] = cc
	return cc
}

// refreshMetadata asks the bootstrap address for the topic's partitions and their leaders,
// waiting while the topic is unknown or a partition has no leader (metadata propagating).
func (c *cluster) refreshMetadata() {
	backoff := 50 * time.Millisecond
	deadline := time.Now().Add(overallDeadline)
	for {
		var resp *pb.MetadataResponse
		err := call("Metadata", func(ctx context.Context, opt grpc.CallOption) error {
			var err error
			resp, err = pb.NewBrokerClient(c.conn(c.bootstrap)).Metadata(ctx, &pb.MetadataRequest{Topics: []string{c.topic}}, opt)
			return err
		})
		if err != nil {
			fail("%v", err)
		}
		brokers := map[int32]string{}
		for _, b := range resp.Brokers {
			brokers[b.Id] = b.Address
		}
		leaders := map[uint32]string{}
		complete := false
		for _, t := range resp.Topics {
			if t.Name != c.topic {
				continue
			}
			complete = len(t.Partitions) > 0
			for _, p := range t.Partitions {
				addr, ok := "", false
				if p.Leader != nil {
					addr, ok = brokers[*p.Leader]
				}
				if !ok {
					complete = false
					break
				}
				leaders[p.Partition] = addr
			}
		}
		if complete {
			c.leaders = leaders
			return
		}
		if time.Now().After(deadline) {
			fail("topic %s: no leader for every partition after %v", c.topic, overallDeadline)
		}
		time.Sleep(backoff)
		if backoff *= 2; backoff > time.Second {
			backoff = time.Second
		}
	}
}

type record struct {
	key, value string
}

// produce sends every partition's records to its leader with acks=-1, one request per
// leader, and returns the offset each value was written at. Partitions that fail with a
// retriable code are sent again after a metadata refresh. Only a retried
// REQUEST_TIMED_OUT or NOT_ENOUGH_REPLICAS_AFTER_APPEND can write a batch twice; the
// exactly-once check after fetching would report it.
func (c *cluster) produce(byPartition map[uint32][]record) map[uint32]map[int64]string {
	acked := map[uint32]map[int64]string{}
	pending := map[uint32]bool{}
	for p := range byPartition {
		pending[p] = true
	}
	backoff := 50 * time.Millisecond
	deadline := time.Now().Add(overallDeadline)
	for len(pending) > 0 {
		byLeader := map[string][]uint32{}
		for p := range pending {
			byLeader[c.leaders[p]] = append(byLeader[c.leaders[p]], p)
		}
		var retryReasons []string
		for leader, parts := range byLeader {
			req := &pb.ProduceRequest{Acks: proto.Int32(-1), TimeoutMs: 10000}
			data := &pb.TopicProduceData{Topic: c.topic}
			for _, p := range parts {
				pd := &pb.PartitionProduceData{Partition: p}
				for _, r := range byPartition[p] {
					pd.Records = append(pd.Records, &pb.Record{
						Key:     []byte(r.key),
						Value:   []byte(r.value),
						Headers: []*pb.Header{{Key: "lang", Value: []byte("go")}},
					})
				}
				data.Partitions = append(data.Partitions, pd)
			}
			req.Topics = []*pb.TopicProduceData{data}

			var trailer metadata.MD
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			resp, err := pb.NewBrokerClient(c.conn(leader)).Produce(ctx, req, grpc.Trailer(&trailer))
			cancel()
			if err != nil {
				// The whole request failed: retry all of its partitions, or give up.
				ce := classify(err, trailer)
				if !ce.retriable {
					fail("produce to %s: %v", leader, ce)
				}
				retryReasons = append(retryReasons, fmt.Sprintf("%s: %v", leader, ce))
				continue
			}
			for _, t := range resp.Topics {
				for _, pr := range t.Partitions {
					switch {
					case pr.ErrorCode == pb.ErrorCode_NONE:
						offsets := map[int64]string{}
						for i, r := range byPartition[pr.Partition] {
							offsets[pr.BaseOffset+int64(i)] = r.value
						}
						acked[pr.Partition] = offsets
						delete(pending, pr.Partition)
					case retriablePartitionErrors[pr.ErrorCode]:
						retryReasons = append(retryReasons, fmt.Sprintf("partition %d: %v", pr.Partition, pr.ErrorCode))
					default:
						fail("produce to partition %d: %v: %s", pr.Partition, pr.ErrorCode, pr.ErrorMessage)
					}
				}
			}
		}
		if len(pending) == 0 {
			break
		}
		if time.Now().After(deadline) {
			fail("produce: still failing after %v: %s", overallDeadline, strings.Join(retryReasons, "; "))
		}
		time.Sleep(backoff)
		if backoff *= 2; backoff > time.Second {
			backoff = time.Second
		}
		c.refreshMetadata()
	}
	return acked
}

// fetch reads every partition from the first offset produce acknowledged there until all
// of this run's values (those starting with prefix) are back, and checks that each arrives
// once, at its acknowledged offset, with its header.
func (c *cluster) fetch(acked map[uint32]map[int64]string, prefix string) map[uint32]int {
	next := map[uint32]int64{}
	for p, offsets := range acked {
		first := int64(-1)
		for o := range offsets {
			if first < 0 || o < first {
				first = o
			}
		}
		next[p] = first
	}
	seen := map[string]bool{}
	perPartition := map[uint32]int{}
	backoff := 50 * time.Millisecond
	deadline := time.Now().Add(overallDeadline)
	for len(seen) < numRecords {
		if time.Now().After(deadline) {
			fail("fetch: %d of %d records back after %v", len(seen), numRecords, overallDeadline)
		}
		byLeader := map[string][]uint32{}
		for p := range next {
			if perPartition[p] < len(acked[p]) {
				byLeader[c.leaders[p]] = append(byLeader[c.leaders[p]], p)
			}
		}
		refresh := false
		for leader, parts := range byLeader {
			ft := &pb.FetchTopic{Topic: c.topic}
			for _, p := range parts {
				ft.Partitions = append(ft.Partitions, &pb.FetchPartition{Partition: p, FetchOffset: next[p]})
			}
			var resp *pb.FetchResponse
			err := call("fetch from "+leader, func(ctx context.Context, opt grpc.CallOption) error {
				var err error
				resp, err = pb.NewBrokerClient(c.conn(leader)).Fetch(ctx, &pb.FetchRequest{
					MaxWaitMs: 500,
					MinBytes:  1,
					Topics:    []*pb.FetchTopic{ft},
				}, opt)
				return err
			})
			if err != nil {
				fail("%v", err)
			}
			for _, t := range resp.Topics {
				for _, pr := range t.Partitions {
					if pr.ErrorCode != pb.ErrorCode_NONE {
						if !retriablePartitionErrors[pr.ErrorCode] {
							fail("fetch partition %d: %v: %s", pr.Partition, pr.ErrorCode, pr.ErrorMessage)
						}
						refresh = true
						continue
					}
					for _, r := range pr.Records {
						next[pr.Partition] = r.Offset + 1
						value := string(r.Value)
						if !strings.HasPrefix(value, prefix) {
							continue // another producer's record
						}
						if seen[value] {
							fail("value %q arrived twice (again at partition %d offset %d)", value, pr.Partition, r.Offset)
						}
						if want := acked[pr.Partition][r.Offset]; want != value {
							fail("partition %d offset %d: got %q, produce acknowledged %q", pr.Partition, r.Offset, value, want)
						}
						if len(r.Headers) != 1 || r.Headers[0].Key != "lang" || string(r.Headers[0].Value) != "go" {
							fail("partition %d offset %d: unexpected headers %v", pr.Partition, r.Offset, r.Headers)
						}
						seen[value] = true
						perPartition[pr.Partition]++
					}
				}
			}
		}
		if refresh {
			time.Sleep(backoff)
			if backoff *= 2; backoff > time.Second {
				backoff = time.Second
			}
			c.refreshMetadata()
		}
	}
	return perPartition
}

// murmur2 is Kafka's murmur2 hash (org.apache.kafka.common.utils.Utils.murmur2), so a key
// lands in the same partition as with Kafka's default partitioner and tidelog's own client.
func murmur2(data []byte) int32 {
	const seed uint32 = 0x9747b28c
	const m uint32 = 0x5bd1e995
	n := len(data)
	h := seed ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := binary.LittleEndian.Uint32(data[i:])
		k *= m
		k ^= k >> 24
		k *= m
		h *= m
		h ^= k
	}
	tail := data[n&^3:]
	switch len(tail) {
	case 3:
		h ^= uint32(tail[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(tail[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(tail[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int32(h)
}

func partitionForKey(key []byte, partitions int) uint32 {
	return uint32(murmur2(key)&0x7fffffff) % uint32(partitions)
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "produce_consume: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	address := os.Getenv("TIDELOG_BOOTSTRAP")
	if address == "" {
		address = "127.0.0.1:9292"
	}
	if len(os.Args) > 1 {
		address = os.Args[1]
	}
	address = strings.TrimSpace(strings.Split(address, ",")[0])
	topic := "go-example"
	if len(os.Args) > 2 {
		topic = os.Args[2]
	}
	start := time.Now()
	c := &cluster{bootstrap: address, topic: topic, conns: map[string]*grpc.ClientConn{}}
	defer func() {
		for _, cc := range c.conns {
			cc.Close()
		}
	}()

	created := "created"
	err := call("CreateTopic", func(ctx context.Context, opt grpc.CallOption) error {
		_, err := pb.NewAdminClient(c.conn(address)).CreateTopic(ctx, &pb.CreateTopicRequest{
			Name:       topic,
			Partitions: proto.Uint32(numPartitions),
		}, opt)
		return err
	})
	if err != nil {
		var ce *callError
		if !errors.As(err, &ce) || ce.code != "TOPIC_ALREADY_EXISTS" {
			fail("%v", err)
		}
		created = "existing"
	}

	c.refreshMetadata()
	partitions := len(c.leaders)

	// This run's values carry a random prefix, so records of earlier runs on the same
	// topic are told apart.
	id := make([]byte, 4)
	if _, err := rand.Read(id); err != nil {
		fail("random: %v", err)
	}
	prefix := "go-" + hex.EncodeToString(id) + "-"
	byPartition := map[uint32][]record{}
	for i := 0; i < numRecords; i++ {
		key := fmt.Sprintf("key-%d", i)
		p := partitionForKey([]byte(key), partitions)
		byPartition[p] = append(byPartition[p], record{key: key, value: fmt.Sprintf("%srecord-%d", prefix, i)})
	}

	acked := c.produce(byPartition)
	perPartition := c.fetch(acked, prefix)

	var counts []string
	var ids []int
	for p := range perPartition {
		ids = append(ids, int(p))
	}
	sort.Ints(ids)
	for _, p := range ids {
		counts = append(counts, fmt.Sprintf("p%d=%d", p, perPartition[uint32(p)]))
	}
	fmt.Printf("produced and consumed %d records (keyed, acks=-1, each exactly once) on %s topic %s (%d partitions: %s) at %s in %.1fs\n",
		numRecords, created, topic, partitions, strings.Join(counts, " "), address, time.Since(start).Seconds())
}
