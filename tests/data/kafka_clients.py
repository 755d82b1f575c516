"""The Kafka-client side of tests/kafka.rs: confluent-kafka (librdkafka), kafka-python,
aiokafka.

  create BOOTSTRAP TOPIC PARTITIONS        create a topic through the AdminClient
  produce BOOTSTRAP TOPIC N COMPRESSION    N keyed records with headers and timestamps,
                                           idempotent, acks=all, Kafka's murmur2 partitioner;
                                           prints one JSON line per acknowledged record
  consume BOOTSTRAP TOPIC PARTITIONS N     an assigned (not group) consumer from the
                                           beginning of every partition until N records;
                                           prints one JSON line per record
  group_consume BOOTSTRAP TOPIC GROUP N PROTOCOL
                                           a group consumer (classic or consumer protocol)
                                           until N records, committing after each; prints
                                           one JSON line per record
  member BOOTSTRAP TOPIC GROUP PROTOCOL IDLE_S
                                           one group member: prints each record, commits it
                                           synchronously and prints {"committed": [p, o]};
                                           exits after IDLE_S seconds without a record
  committed BOOTSTRAP GROUP TOPIC PARTITIONS
                                           the group's committed offsets, one JSON line each
  produce_through_failures BOOTSTRAP TOPIC N
                                           an idempotent acks=all producer retrying through
                                           leader failures; one {"ack": i, ...} line per record
  admin BOOTSTRAP TOPIC                     AdminClient: configs, cluster, elections,
                                           DeleteRecords, group offsets (JSON per step)
  groups BOOTSTRAP GROUP                    AdminClient: list groups, describe GROUP, delete it
  roundtrip CLIENT BOOTSTRAP TOPIC N       CLIENT (kafka-python or aiokafka): create a
                                           6-partition topic through its admin client,
                                           produce N keyed records with headers and
                                           timestamps (acks=all), consume them in group
                                           "CLIENT-group" committing; prints {"ack": ...}
                                           lines, then one JSON line per record
  txn_abort BOOTSTRAP TOPIC N               a transactional producer writes N records
                                           ("aborted-i") to every partition and aborts
  eos_copy BOOTSTRAP SRC DST GROUP TXN_ID IDLE_S
                                           exactly-once copy: a read_committed group consumer
                                           of SRC and a transactional producer to DST commit
                                           each batch's output and input offsets in one
                                           transaction (send_offsets_to_transaction); exits
                                           after IDLE_S seconds without a record; prints
                                           {"copied": n, "transactions": t}
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


def record_json(partition, offset, key, value, headers, timestamp):
    return json.dumps({
        "partition": partition, "offset": offset,
        "key": key.decode() if key is not None else None,
        "value": value.decode(),
        "headers": [[k, v.decode()] for k, v in (headers or [])],
        "timestamp": timestamp,
    })


def group_consume(bootstrap, topic, group, n, protocol):
    c = Consumer(group_config(bootstrap, group, protocol))
    c.subscribe([topic])
    got = 0
    deadline = time.time() + 90
    while got < int(n) and time.time() < deadline:
        msg = c.poll(0.5)
        if msg is None:
            continue
        if msg.error():
            raise KafkaException(msg.error())
        print(record_json(msg.partition(), msg.offset(), msg.key(), msg.value(),
                          msg.headers(), msg.timestamp()[1]))
        got += 1
        c.commit(message=msg, asynchronous=False)
    c.close()


def group_config(bootstrap, group, protocol):
    conf = {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "group.protocol": protocol,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    }
    if protocol == "classic":
        conf["session.timeout.ms"] = 6000
        conf["heartbeat.interval.ms"] = 500
    return conf


def member(bootstrap, topic, group, protocol, idle_s):
    c = Consumer(group_config(bootstrap, group, protocol))
    c.subscribe([topic])
    last = time.time()
    deadline = time.time() + 180
    while time.time() - last < float(idle_s) and time.time() < deadline:
        msg = c.poll(0.2)
        if msg is None:
            continue
        if msg.error():
            print(json.dumps({"error": str(msg.error())}), flush=True)
            continue
        last = time.time()
        print(json.dumps({"partition": msg.partition(), "offset": msg.offset(),
                          "key": msg.key().decode()}), flush=True)
        try:
            c.commit(message=msg, asynchronous=False)
            print(json.dumps({"committed": [msg.partition(), msg.offset() + 1]}), flush=True)
        except KafkaException as e:
            # A commit refused during a rebalance: the record is read again by whoever
            # holds the partition next.
            print(json.dumps({"commit_error": str(e)}), flush=True)
        time.sleep(0.002)
    c.close()


def committed(bootstrap, group, topic, partitions):
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    for tp in c.committed([TopicPartition(topic, p) for p in range(int(partitions))], timeout=20):
        print(json.dumps({"partition": tp.partition, "offset": tp.offset}))
    c.close()


def produced(i):
    return (f"k{i}".encode(), f"v{i}".encode(),
            [("h", f"{i}".encode()), ("dup", b"a"), ("dup", b"b")], BASE_TS + i)


def roundtrip(client, bootstrap, topic, n):
    n = int(n)
    group = f"{client}-group"
    if client == "kafka-python":
        from kafka import KafkaConsumer, KafkaProducer
        from kafka.admin import KafkaAdminClient, NewTopic as KNewTopic
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([KNewTopic(topic, 6, 1)])
        admin.close()
        p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        futures = []
        for i in range(n):
            key, value, headers, ts = produced(i)
            futures.append((key, p.send(topic, key=key, value=value, headers=headers,
                                        timestamp_ms=ts)))
        p.flush(60)
        for key, f in futures:
            md = f.get(timeout=60)
            print(json.dumps({"ack": key.decode(), "partition": md.partition, "offset": md.offset}))
        p.close()
        c = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                          auto_offset_reset="earliest", enable_auto_commit=False,
                          consumer_timeout_ms=30000)
        got = 0
        for m in c:
            print(record_json(m.partition, m.offset, m.key, m.value, m.headers, m.timestamp))
            got += 1
            if got >= n:
                break
        c.commit()
        c.close()
    elif client == "aiokafka":
        import asyncio
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic as ANewTopic

        async def run():
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
            await admin.start()
            await admin.create_topics([ANewTopic(topic, 6, 1)])
            await admin.close()
            p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
            await p.start()
            try:
                futures = []
                for i in range(n):
                    key, value, headers, ts = produced(i)
                    futures.append((key, await p.send(topic, key=key, value=value,
                                                      headers=headers, timestamp_ms=ts)))
                for key, f in futures:
                    md = await f
                    print(json.dumps({"ack": key.decode(), "partition": md.partition,
                                      "offset": md.offset}))
            finally:
                await p.stop()
            c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                 auto_offset_reset="earliest", enable_auto_commit=False)
            await c.start()
            try:
                got = 0
                deadline = time.time() + 90
                while got < n and time.time() < deadline:
                    batches = await c.getmany(timeout_ms=500)
                    for ms in batches.values():
                        for m in ms:
                            print(record_json(m.partition, m.offset, m.key, m.value,
                                              m.headers, m.timestamp))
                            got += 1
                await c.commit()
            finally:
                await c.stop()

        asyncio.run(run())
    else:
        sys.exit(f"unknown client {client}")


def groups(bootstrap, group):
    """Lists, describes and deletes GROUP through confluent-kafka's AdminClient."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    listed = admin.list_consumer_groups(request_timeout=20).result(timeout=30)
    print(json.dumps({"listed": sorted(g.group_id for g in listed.valid)}))
    d = admin.describe_consumer_groups([group], request_timeout=20)[group].result(timeout=30)
    print(json.dumps({"state": d.state.name, "members": len(d.members)}))
    admin.delete_consumer_groups([group], request_timeout=20)[group].result(timeout=30)
    print(json.dumps({"deleted": True}))


def produce_through_failures(bootstrap, topic, n):
    """An idempotent acks=all producer that retries through leader failures; prints one
    {"ack": i, "partition": p, "offset": o} line per acknowledged record, as it comes."""
    p = Producer({
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "message.timeout.ms": 120000,
        "retry.backoff.ms": 100,
        "topic.metadata.refresh.interval.ms": 1000,
    })
    failed = []

    def done(err, msg):
        if err is not None:
            failed.append(str(err))
        else:
            print(json.dumps({"ack": int(msg.value()), "partition": msg.partition(),
                              "offset": msg.offset()}), flush=True)

    for i in range(int(n)):
        while True:
            try:
                p.produce(topic, key=f"k{i}", value=f"{i}", on_delivery=done)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
        time.sleep(0.0005)
    left = p.flush(150)
    if left or failed:
        sys.exit(f"{left} records not delivered; errors: {failed[:5]}")


def admin(bootstrap, topic):
    """confluent-kafka's AdminClient against TOPIC (2 partitions, 100 records in each):
    configs, cluster, leader election, record deletion, group offsets; one JSON line per
    step."""
    from confluent_kafka import ConsumerGroupTopicPartitions, ElectionType
    from confluent_kafka.admin import (AlterConfigOpType, ConfigEntry, ConfigResource,
                                       OffsetSpec)
    a = AdminClient({"bootstrap.servers": bootstrap})
    res = ConfigResource("TOPIC", topic, incremental_configs=[
        ConfigEntry("retention.ms", "3600000",
                    incremental_operation=AlterConfigOpType.SET)])
    a.incremental_alter_configs([res])[res].result(timeout=30)
    bad = ConfigResource("TOPIC", topic, incremental_configs=[
        ConfigEntry("retention.ms", "soon", incremental_operation=AlterConfigOpType.SET)])
    try:
        a.incremental_alter_configs([bad])[bad].result(timeout=30)
        bad_error = None
    except KafkaException as e:
        bad_error = e.args[0].name()
    d = a.describe_configs([ConfigResource("TOPIC", topic)])
    configs = list(d.values())[0].result(timeout=30)
    print(json.dumps({"retention.ms": configs["retention.ms"].value, "bad": bad_error}))
    c = a.describe_cluster(request_timeout=20).result(timeout=30)
    print(json.dumps({"cluster_id": c.cluster_id, "nodes": len(c.nodes)}))
    tps = [TopicPartition(topic, 0)]
    e = a.elect_leaders(ElectionType.PREFERRED, tps).result(timeout=30)
    print(json.dumps({"elect": {f"{tp.topic}-{tp.partition}": (err.name() if err else None)
                                for tp, err in e.items()}}))
    futs = a.delete_records([TopicPartition(topic, 0, 40)])
    low = {f"{tp.partition}": f.result(timeout=30).low_watermark for tp, f in futs.items()}
    offs = a.list_offsets({TopicPartition(topic, 0): OffsetSpec.earliest()})
    earliest = {f"{tp.partition}": f.result(timeout=30).offset for tp, f in offs.items()}
    offs = a.list_offsets({TopicPartition(topic, 1): OffsetSpec.max_timestamp()})
    top = [(f.result(timeout=30).offset, f.result(timeout=30).timestamp) for f in offs.values()]
    print(json.dumps({"low_watermark": low, "earliest": earliest, "max_timestamp": top[0]}))
    g = ConsumerGroupTopicPartitions("admin-group", [TopicPartition(topic, 1, 77)])
    a.alter_consumer_group_offsets([g])["admin-group"].result(timeout=30)
    got = a.list_consumer_group_offsets([ConsumerGroupTopicPartitions("admin-group")])
    listed = got["admin-group"].result(timeout=30)
    print(json.dumps({"group_offsets": {f"{tp.partition}": tp.offset
                                        for tp in listed.topic_partitions}}))


def delete_records(bootstrap, topic, partitions, before):
    """Deletes the records before offset `before` of every partition (DeleteRecords)."""
    a = AdminClient({"bootstrap.servers": bootstrap})
    tps = [TopicPartition(topic, p, int(before)) for p in range(int(partitions))]
    futs = a.delete_records(tps)
    print(json.dumps({f"{tp.partition}": f.result(timeout=30).low_watermark
                      for tp, f in futs.items()}))


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


def txn_abort(bootstrap, topic, n):
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": "py-aborter"})
    p.init_transactions(30)
    p.begin_transaction()
    partitions = len(p.list_topics(topic, timeout=10).topics[topic].partitions)
    for i in range(int(n)):
        p.produce(topic, value=f"aborted-{i}".encode(), partition=i % partitions)
    p.flush(30)
    p.abort_transaction(30)
    print(json.dumps({"aborted": int(n)}))


def eos_copy(bootstrap, src, dst, group, txn_id, idle_s):
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    })
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id})
    producer.init_transactions(30)
    consumer.subscribe([src])
    copied = transactions = 0
    last = time.time()
    while time.time() - last < float(idle_s):
        msgs = consumer.consume(500, 0.5)
        msgs = [m for m in msgs if m.error() is None]
        if not msgs:
            continue
        last = time.time()
        producer.begin_transaction()
        for m in msgs:
            producer.produce(dst, key=m.key(), value=m.value(), partition=m.partition())
        producer.send_offsets_to_transaction(
            consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30)
        producer.commit_transaction(30)
        copied += len(msgs)
        transactions += 1
    consumer.close()
    print(json.dumps({"copied": copied, "transactions": transactions}))


if __name__ == "__main__":
    {"create": create, "produce": produce, "consume": consume, "group_consume": group_consume,
     "member": member, "committed": committed, "roundtrip": roundtrip, "groups": groups,
     "produce_through_failures": produce_through_failures, "admin": admin,
     "delete_records": delete_records, "txn_abort": txn_abort,
     "eos_copy": eos_copy}[sys.argv[1]](*sys.argv[2:])
