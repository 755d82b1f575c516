"""confluent-kafka (librdkafka) side of tests/kafka.rs.

  create BOOTSTRAP TOPIC PARTITIONS        create a topic through the AdminClient
  produce BOOTSTRAP TOPIC N COMPRESSION    N keyed records with headers and timestamps,
                                           idempotent, acks=all, Kafka's murmur2 partitioner;
                                           prints one JSON line per acknowledged record
  consume BOOTSTRAP TOPIC PARTITIONS N     an assigned (not group) consumer from the
                                           beginning of every partition until N records;
                                           prints one JSON line per record
"""
import json
import sys
import time

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

BASE_TS = 1_700_000_000_000


def create(bootstrap, topic, partitions):
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, int(partitions), 1)], request_timeout=20)
    futures[topic].result(timeout=30)
    print("created")


def produce(bootstrap, topic, n, compression):
    p = Producer({
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": compression,
        "partitioner": "murmur2_random",
        "linger.ms": 5,
    })
    out = []
    failed = []

    def done(err, msg):
        if err is not None:
            failed.append(str(err))
        else:
            out.append({"key": msg.key().decode(), "partition": msg.partition(), "offset": msg.offset()})

    for i in range(int(n)):
        while True:
            try:
                p.produce(topic, key=f"k{i}", value=f"v{i}",
                          headers=[("h", f"{i}".encode()), ("dup", b"a"), ("dup", b"b")],
                          timestamp=BASE_TS + i, on_delivery=done)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    left = p.flush(60)
    if left or failed:
        sys.exit(f"{left} records not delivered; errors: {failed[:5]}")
    for r in out:
        print(json.dumps(r))


def consume(bootstrap, topic, partitions, n):
    c = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": "unused-assigned-only",
        "enable.auto.commit": False,
        "enable.partition.eof": False,
    })
    c.assign([TopicPartition(topic, p, -2) for p in range(int(partitions))])
    got = 0
    deadline = time.time() + 60
    while got < int(n) and time.time() < deadline:
        msg = c.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            raise KafkaException(msg.error())
        headers = [[k, v.decode()] for k, v in (msg.headers() or [])]
        print(json.dumps({
            "partition": msg.partition(), "offset": msg.offset(),
            "key": msg.key().decode() if msg.key() is not None else None,
            "value": msg.value().decode(), "headers": headers,
            "timestamp": msg.timestamp()[1],
        }))
        got += 1
    c.close()


if __name__ == "__main__":
    {"create": create, "produce": produce, "consume": consume}[sys.argv[1]](*sys.argv[2:])
