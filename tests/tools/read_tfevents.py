#!/usr/bin/env python3
"""An independent reader of TensorBoard event files (standard library only).

Usage: read_tfevents.py LOGDIR
Walks LOGDIR for events.out.tfevents.* files, checks every TFRecord (both masked CRC32C
checksums, computed here bit by bit, not from a table) and decodes each Event protobuf from its
wire format. Prints one JSON object:
  {"runs": {RUN: {"file_version": "...", "records": N,
                  "scalars": {TAG: [[step, value], ...]}}}}
where RUN is the event file's folder relative to LOGDIR. Exits 1 with a message naming the file
and offset on the first malformed byte (bad length CRC, bad data CRC, truncated record,
malformed protobuf, a first record that is not file_version "brain.Event:2").
"""
import json
import os
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class Malformed(Exception):
    pass


def varint(buf, pos):
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise Malformed("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise Malformed("varint too long")


def fields(buf):
    """Yields (field number, wire type, value) of a protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise Malformed("truncated fixed64")
            value = buf[pos:pos + 8]
            pos += 8
        elif wire == 2:
            n, pos = varint(buf, pos)
            if pos + n > len(buf):
                raise Malformed("truncated bytes field")
            value = buf[pos:pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise Malformed("truncated fixed32")
            value = buf[pos:pos + 4]
            pos += 4
        else:
            raise Malformed("unknown wire type %d" % wire)
        yield number, wire, value


def decode_event(data):
    event = {"wall_time": None, "step": 0, "file_version": None, "values": []}
    for number, wire, value in fields(data):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            event["file_version"] = value.decode("utf-8")
        elif number == 5 and wire == 2:
            for vn, vw, vv in fields(value):
                if vn != 1 or vw != 2:
                    raise Malformed("Summary holds field %d (wire %d)" % (vn, vw))
                tag, simple = None, None
                for tn, tw, tv in fields(vv):
                    if tn == 1 and tw == 2:
                        tag = tv.decode("utf-8")
                    elif tn == 2 and tw == 5:
                        simple = struct.unpack("<f", tv)[0]
                if tag is None or simple is None:
                    raise Malformed("Summary.Value without tag or simple_value")
                event["values"].append((tag, simple))
        else:
            raise Malformed("Event field %d (wire %d) unexpected" % (number, wire))
    if event["wall_time"] is None:
        raise Malformed("Event without wall_time")
    return event


def read_file(path):
    with open(path, "rb") as f:
        buf = f.read()
    pos, events = 0, []
    while pos < len(buf):
        where = "%s at offset %d" % (path, pos)
        if pos + 12 > len(buf):
            raise Malformed(where + ": truncated record header")
        header = buf[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
        if masked(header) != length_crc:
            raise Malformed(where + ": length CRC mismatch")
        start = pos + 12
        if start + length + 4 > len(buf):
            raise Malformed(where + ": truncated record data")
        data = buf[start:start + length]
        (data_crc,) = struct.unpack("<I", buf[start + length:start + length + 4])
        if masked(data) != data_crc:
            raise Malformed(where + ": data CRC mismatch")
        try:
            events.append(decode_event(data))
        except Malformed as e:
            raise Malformed(where + ": " + str(e))
        pos = start + length + 4
    if not events or events[0]["file_version"] != "brain.Event:2":
        raise Malformed(path + ": the first record is not file_version brain.Event:2")
    return events


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    logdir = sys.argv[1]
    runs = {}
    for root, _, files in os.walk(logdir):
        for name in sorted(files):
            if "tfevents" not in name:
                continue
            path = os.path.join(root, name)
            try:
                events = read_file(path)
            except Malformed as e:
                print("read_tfevents: " + str(e), file=sys.stderr)
                return 1
            run = runs.setdefault(os.path.relpath(root, logdir),
                                  {"file_version": events[0]["file_version"], "records": 0,
                                   "scalars": {}})
            run["records"] += len(events)
            for event in events:
                for tag, value in event["values"]:
                    run["scalars"].setdefault(tag, []).append([event["step"], value])
    print(json.dumps({"runs": runs}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
