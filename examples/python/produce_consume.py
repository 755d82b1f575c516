"""Produce and consume 1,000 records against a running tidelog, from Python.

Stubs are generated from ../../proto with grpcio-tools (see run.sh). Usage:
    python produce_consume.py [ADDRESS]    (default: $TIDELOG_BOOTSTRAP or 127.0.0.1:9292)
"""

import os
import sys
import time
import uuid

import grpc

from tidelog.v1 import admin_pb2, admin_pb2_grpc, broker_pb2, broker_pb2_grpc, common_pb2

RECORDS = 1000
RETRIABLE = {"NOT_LEADER_OR_FOLLOWER", "UNKNOWN_TOPIC_OR_PARTITION", "REQUEST_TIMED_OUT"}


def error_code(exc: grpc.RpcError) -> str:
    """The machine-readable code a failed call carries in its trailing metadata."""
    for key, value in exc.trailing_metadata() or ():
        if key == "tidelog-error-code":
            return value
    return exc.code().name


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("TIDELOG_BOOTSTRAP", "127.0.0.1:9292")
    address = address.split(",")[0]
    topic = f"python-example-{uuid.uuid4().hex[:8]}"
    channel = grpc.insecure_channel(address)
    admin = admin_pb2_grpc.AdminStub(channel)
    admin.CreateTopic(admin_pb2.CreateTopicRequest(name=topic, partitions=2), timeout=30)

    # Bad input gets a machine-readable code.
    try:
        admin.CreateTopic(admin_pb2.CreateTopicRequest(name="no spaces allowed"), timeout=30)
        raise SystemExit("an invalid topic name was accepted")
    except grpc.RpcError as exc:
        assert error_code(exc) == "INVALID_TOPIC", error_code(exc)

    # Find each partition's leader, then produce to it.
    metadata = broker_pb2_grpc.BrokerStub(channel).Metadata(broker_pb2.MetadataRequest(topics=[topic]), timeout=30)
    brokers = {b.id: b.address for b in metadata.brokers}
    partitions = {p.partition: brokers[p.leader] for p in metadata.topics[0].partitions}
    stubs = {addr: broker_pb2_grpc.BrokerStub(grpc.insecure_channel(addr)) for addr in set(partitions.values())}

    sent = {}
    for partition, leader in partitions.items():
        values = [f"record-{i}" for i in range(RECORDS) if i % len(partitions) == partition]
        request = broker_pb2.ProduceRequest(
            acks=-1,
            timeout_ms=10_000,
            topics=[
                broker_pb2.TopicProduceData(
                    topic=topic,
                    partitions=[
                        broker_pb2.PartitionProduceData(
                            partition=partition,
                            records=[
                                broker_pb2.Record(
                                    key=f"key-{v}".encode(),
                                    value=v.encode(),
                                    headers=[broker_pb2.Header(key="lang", value=b"python")],
                                )
                                for v in values
                            ],
                        )
                    ],
                )
            ],
        )
        # Retriable codes (a partition still opening, a leader moving) are retried.
        for _ in range(50):
            result = stubs[leader].Produce(request, timeout=30).topics[0].partitions[0]
            if common_pb2.ErrorCode.Name(result.error_code) not in RETRIABLE:
                break
            time.sleep(0.1)
        if result.error_code != common_pb2.NONE:
            raise SystemExit(f"produce failed: {common_pb2.ErrorCode.Name(result.error_code)}: {result.error_message}")
        for i, v in enumerate(values):
            sent[(partition, result.base_offset + i)] = v

    received = {}
    for partition, leader in partitions.items():
        offset = 0
        while True:
            response = stubs[leader].Fetch(
                broker_pb2.FetchRequest(
                    max_wait_ms=500,
                    min_bytes=1,
                    topics=[
                        broker_pb2.FetchTopic(
                            topic=topic,
                            partitions=[broker_pb2.FetchPartition(partition=partition, fetch_offset=offset)],
                        )
                    ],
                ),
                timeout=30,
            )
            p = response.topics[0].partitions[0]
            if p.error_code != common_pb2.NONE:
                raise SystemExit(f"fetch failed: {common_pb2.ErrorCode.Name(p.error_code)}: {p.error_message}")
            for r in p.records:
                assert dict((h.key, h.value) for h in r.headers) == {"lang": b"python"}
                received[(partition, r.offset)] = r.value.decode()
            if not p.records:
                break
            offset = p.records[-1].offset + 1

    if received != sent:
        raise SystemExit(f"mismatch: sent {len(sent)} records, received {len(received)}")
    admin.DeleteTopic(admin_pb2.DeleteTopicRequest(name=topic), timeout=30)
    print(f"produced and consumed {len(received)} records on {topic} at {address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
