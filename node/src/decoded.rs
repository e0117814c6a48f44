//! What a protobuf message will cost in memory once tonic has decoded it, bounded from its
//! bytes *before* it is decoded (docs/DESIGN.md §43, "Decoded size").
//!
//! prost decodes a repeated field into a `Vec` of the element's Rust type. An element's
//! wire form can be two bytes (a tag and an empty length) while its Rust form is the
//! whole struct, inline: an `ExecuteRequest` of 524,288 empty `Command`s is 1 MiB on the
//! wire and ~115 MB decoded. Admission ([`crate::admission`]) charges a call's byte
//! budget with this bound, so the memory of calls being decoded and handled is bounded
//! by the budget whatever the message's shape.
//!
//! The bound walks the message with the schema (the descriptors compiled into
//! `allot_proto::FILE_DESCRIPTOR_SET`) without allocating. The decoded size is at most:
//! the wire bytes twice (tonic's buffer, and the strings and bytes prost copies out of
//! it), plus the input struct's size, plus for every element of a repeated field found
//! at any depth three times the element's size (a `Vec` grown by pushing has up to
//! twice its length in capacity, and holds the old block too while it grows): a message element's
//! struct, a string's header, a packed scalar's `u64` per byte of the field. Struct
//! sizes are upper bounds computed from the descriptors (`rust_size`), checked against
//! `size_of` of prost's structs by `tests::element_bytes_covers_every_repeated_element`,
//! which also fails when the schema gains a repeated message type not checked yet.

use prost::Message;
use std::collections::HashMap;
use std::sync::OnceLock;

/// prost's own recursion limit: a message nested deeper is refused by prost anyway.
const DEPTH_MAX: usize = 100;
/// How many times its final length a `Vec` grown by pushing may hold at once: its
/// capacity is at most twice its length, and while it grows the allocator holds the old
/// block and the new one together.
const GROWTH: usize = 3;
/// What one element of a packed scalar field costs once decoded, per byte of the field
/// (an element is at least one byte, at most a `u64` in the `Vec`).
const PACKED_BYTES_PER_BYTE: usize = GROWTH * 8;
/// One element of a repeated string, bytes or unpacked scalar field: a `String` or
/// `Vec` header (the characters are counted in the wire bytes).
const REPEATED_OTHER_BYTES: usize = GROWTH * 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A field of a message type (index into [`Schema::fields`]); `repeated` when each
    /// occurrence is a new element of a `Vec` (or a map entry).
    Message { index: usize, repeated: bool },
    /// A repeated scalar (packed or not).
    Packed,
    /// A repeated string or bytes field.
    RepeatedOther,
    /// A singular scalar, string, bytes or enum: inline, or copied bytes.
    Other,
}

/// Every message type's fields and Rust size, and every method's input type.
pub struct Schema {
    fields: Vec<HashMap<u32, Kind>>,
    /// An upper bound of each message type's Rust size (`size_of` of prost's struct).
    sizes: Vec<usize>,
    methods: HashMap<String, usize>,
}

/// The message does not parse as protobuf (tonic would refuse it too).
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed;

impl Schema {
    /// The schema of allot's own services (Api, Admin, Raft), built once.
    pub fn allot() -> &'static Schema {
        static SCHEMA: OnceLock<Schema> = OnceLock::new();
        SCHEMA.get_or_init(|| Schema::from_descriptors(allot_proto::FILE_DESCRIPTOR_SET))
    }

    /// Built from an encoded `FileDescriptorSet`. A set that does not decode gives an
    /// empty schema (every call is then charged its wire bytes only); allot's own set is
    /// compiled in and checked by the tests.
    pub fn from_descriptors(bytes: &[u8]) -> Schema {
        let set = prost_types::FileDescriptorSet::decode(bytes).unwrap_or_default();
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut messages = Vec::new();
        fn collect<'a>(
            prefix: &str,
            msgs: &'a [prost_types::DescriptorProto],
            names: &mut HashMap<String, usize>,
            out: &mut Vec<&'a prost_types::DescriptorProto>,
        ) {
            for m in msgs {
                let name = format!("{prefix}.{}", m.name());
                names.insert(name.clone(), out.len());
                out.push(m);
                collect(&name, &m.nested_type, names, out);
            }
        }
        for f in &set.file {
            let prefix = if f.package().is_empty() {
                String::new()
            } else {
                format!(".{}", f.package())
            };
            collect(&prefix, &f.message_type, &mut names, &mut messages);
        }
        use prost_types::field_descriptor_proto::{Label, Type};
        let fields = messages
            .iter()
            .map(|m| {
                m.field
                    .iter()
                    .map(|f| {
                        let repeated = f.label() == Label::Repeated;
                        let kind = match f.r#type() {
                            Type::Message | Type::Group => names
                                .get(f.type_name())
                                .map_or(Kind::Other, |&index| Kind::Message { index, repeated }),
                            Type::String | Type::Bytes if repeated => Kind::RepeatedOther,
                            _ if repeated => Kind::Packed,
                            _ => Kind::Other,
                        };
                        (f.number() as u32, kind)
                    })
                    .collect()
            })
            .collect();
        let mut sizes = vec![None; messages.len()];
        for i in 0..messages.len() {
            rust_size(i, &messages, &names, &mut sizes, 0);
        }
        let sizes = sizes
            .into_iter()
            .map(|s| s.unwrap_or(usize::MAX / 4))
            .collect();
        let mut methods = HashMap::new();
        for f in &set.file {
            for s in &f.service {
                for m in &s.method {
                    let path = if f.package().is_empty() {
                        format!("/{}/{}", s.name(), m.name())
                    } else {
                        format!("/{}.{}/{}", f.package(), s.name(), m.name())
                    };
                    if let Some(&i) = names.get(m.input_type()) {
                        methods.insert(path, i);
                    }
                }
            }
        }
        Schema {
            fields,
            sizes,
            methods,
        }
    }

    /// The bound for a message sent to the method at `path` (`/package.Service/Method`):
    /// `None` if the method is not in the schema (charged its wire bytes only).
    pub fn bound(&self, path: &str, message: &[u8]) -> Option<Result<usize, Malformed>> {
        let &input = self.methods.get(path)?;
        // The wire bytes twice: tonic's buffer holds the message while prost copies its
        // strings and bytes out of it.
        Some(self.heap_in(input, message, 0).map(|heap| {
            (2 * message.len())
                .saturating_add(self.sizes[input])
                .saturating_add(heap)
        }))
    }

    /// The heap `bytes` (a message of type `msg`) decodes to beyond its strings' and
    /// bytes' own contents: the elements of its repeated fields, and of the messages
    /// nested in it.
    fn heap_in(&self, msg: usize, mut bytes: &[u8], depth: usize) -> Result<usize, Malformed> {
        if depth > DEPTH_MAX {
            return Err(Malformed);
        }
        let mut heap = 0usize;
        while !bytes.is_empty() {
            let key = varint(&mut bytes)?;
            let field = u32::try_from(key >> 3).map_err(|_| Malformed)?;
            let kind = self.fields.get(msg).and_then(|f| f.get(&field)).copied();
            let kind = kind.unwrap_or(Kind::Other);
            let payload = match key & 7 {
                0 => {
                    varint(&mut bytes)?;
                    None
                }
                1 => {
                    bytes = bytes.get(8..).ok_or(Malformed)?;
                    None
                }
                5 => {
                    bytes = bytes.get(4..).ok_or(Malformed)?;
                    None
                }
                2 => {
                    let len = usize::try_from(varint(&mut bytes)?).map_err(|_| Malformed)?;
                    let payload = bytes.get(..len).ok_or(Malformed)?;
                    bytes = &bytes[len..];
                    Some(payload)
                }
                // Groups (proto2 only) and the reserved wire types: none in allot's schema.
                _ => return Err(Malformed),
            };
            heap = heap.saturating_add(match (kind, payload) {
                (Kind::Message { index, repeated }, Some(p)) => {
                    let own = if repeated {
                        GROWTH * self.sizes[index]
                    } else {
                        0
                    };
                    own.saturating_add(self.heap_in(index, p, depth + 1)?)
                }
                (Kind::Packed, Some(p)) => p.len().saturating_mul(PACKED_BYTES_PER_BYTE),
                (Kind::Packed, None) => PACKED_BYTES_PER_BYTE,
                (Kind::RepeatedOther, _) => REPEATED_OTHER_BYTES,
                _ => 0,
            });
        }
        Ok(heap)
    }

    /// The upper bound of message type `name`'s Rust size (tests).
    #[cfg(test)]
    fn size_of(&self, name: &str) -> Option<usize> {
        let set = prost_types::FileDescriptorSet::decode(allot_proto::FILE_DESCRIPTOR_SET).ok()?;
        let mut i = 0;
        fn find(msgs: &[prost_types::DescriptorProto], name: &str, i: &mut usize) -> Option<usize> {
            for m in msgs {
                if m.name() == name {
                    return Some(*i);
                }
                *i += 1;
                if let Some(f) = find(&m.nested_type, name, i) {
                    return Some(f);
                }
            }
            None
        }
        for f in &set.file {
            if let Some(at) = find(&f.message_type, name, &mut i) {
                return self.sizes.get(at).copied();
            }
        }
        None
    }
}

/// An upper bound of the size of prost's Rust struct for message `i`: every field at
/// most 8 bytes plus an 8-byte tag if it is optional, a string, bytes or `Vec` 24, a map
/// 48, a singular message its own size plus a tag, a oneof its largest arm plus a tag.
fn rust_size(
    i: usize,
    messages: &[&prost_types::DescriptorProto],
    names: &HashMap<String, usize>,
    sizes: &mut Vec<Option<usize>>,
    depth: usize,
) -> usize {
    if let Some(s) = sizes[i] {
        return s;
    }
    if depth > DEPTH_MAX {
        // A recursive type: prost boxes it (a pointer); say "large" to stay an upper bound.
        return 1 << 20;
    }
    use prost_types::field_descriptor_proto::{Label, Type};
    let m = messages[i];
    let mut field_size = |f: &prost_types::FieldDescriptorProto| -> usize {
        let is_map = f.r#type() == Type::Message
            && names
                .get(f.type_name())
                .is_some_and(|&e| messages[e].options.as_ref().is_some_and(|o| o.map_entry()));
        if is_map {
            48
        } else if f.label() == Label::Repeated || matches!(f.r#type(), Type::String | Type::Bytes) {
            24
        } else if f.r#type() == Type::Message {
            names.get(f.type_name()).map_or(1 << 20, |&n| {
                rust_size(n, messages, names, sizes, depth + 1)
            }) + 8
        } else {
            8 + 8 * usize::from(f.proto3_optional())
        }
    };
    let mut total = 0usize;
    let mut oneofs: HashMap<i32, usize> = HashMap::new();
    for f in &m.field {
        let size = field_size(f);
        match f.oneof_index {
            Some(o) if !f.proto3_optional() => {
                let arm = oneofs.entry(o).or_default();
                *arm = (*arm).max(size);
            }
            _ => total += size,
        }
    }
    total += oneofs.values().map(|a| a + 8).sum::<usize>();
    let total = total.next_multiple_of(8) + 8;
    sizes[i] = Some(total);
    total
}

/// A base-128 varint, consumed from the front of `bytes`.
fn varint(bytes: &mut &[u8]) -> Result<u64, Malformed> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&b, rest) = bytes.split_first().ok_or(Malformed)?;
        *bytes = rest;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_proto::api::v1 as pb;

    const EXECUTE: &str = "/allot.api.v1.Api/Execute";

    #[test]
    fn every_method_of_allots_services_is_in_the_schema() {
        let s = Schema::allot();
        assert!(s.methods.contains_key(EXECUTE), "{:?}", s.methods.keys());
        assert!(s.methods.contains_key("/allot.v1.Admin/Init"));
        assert!(s.methods.contains_key("/allot.v1.Raft/Append"));
        assert!(s.bound("/grpc.health.v1.Health/Check", &[]).is_none());
    }

    #[test]
    fn empty_elements_are_charged_what_they_decode_to() {
        // 524,288 empty commands: 1 MiB on the wire.
        let m = pb::ExecuteRequest {
            shard: None,
            commands: vec![pb::Command::default(); 524_288],
        };
        let bytes = m.encode_to_vec();
        assert_eq!(bytes.len(), 1 << 20);
        let bound = Schema::allot().bound(EXECUTE, &bytes).unwrap().unwrap();
        let decoded = 524_288 * std::mem::size_of::<pb::Command>();
        assert!(
            bound >= decoded,
            "bound {bound} below the decoded commands' {decoded} bytes"
        );
        // A command with a packed list inside is walked into.
        let inner = pb::Command {
            command: Some(pb::command::Command::SetPrices(pb::SetPricesRequest {
                prices: vec![pb::GpuPrice::default(); 1000],
                ..Default::default()
            })),
        };
        let m = pb::ExecuteRequest {
            shard: None,
            commands: vec![inner],
        };
        let b = m.encode_to_vec();
        let bound = Schema::allot().bound(EXECUTE, &b).unwrap().unwrap();
        assert!(bound >= 1000 * std::mem::size_of::<pb::GpuPrice>());
    }

    #[test]
    fn an_ordinary_call_is_charged_little_more_than_its_bytes() {
        let m = pb::ExecuteRequest {
            shard: Some(1),
            commands: vec![
                pb::Command {
                    command: Some(pb::command::Command::CreateOrg(pb::CreateOrgRequest {
                        org: 7,
                        ..Default::default()
                    })),
                };
                16
            ],
        };
        let b = m.encode_to_vec();
        let bound = Schema::allot().bound(EXECUTE, &b).unwrap().unwrap();
        // 16 commands of three fields each, and the shard: ~50 fields.
        assert!(bound < 64 << 10, "{bound}");
    }

    #[test]
    fn bytes_that_are_not_protobuf_are_malformed_and_nothing_panics() {
        let s = Schema::allot();
        for bad in [
            &[0x80u8][..],       // a varint that never ends
            &[0x12, 0x05, 0x00], // a length past the end
            &[0x0b],             // a group
            &[0x11, 1, 2],       // a fixed64 cut short
            &[0xff; 11],         // an 11-byte varint
        ] {
            assert_eq!(s.bound(EXECUTE, bad), Some(Err(Malformed)), "{bad:?}");
        }
        let empty = s.bound(EXECUTE, &[]).unwrap().unwrap();
        assert!(empty >= std::mem::size_of::<pb::ExecuteRequest>() && empty < 1024);
        assert_eq!(
            Schema::from_descriptors(b"not a descriptor set")
                .methods
                .len(),
            0
        );
    }

    /// The size estimates are at least the Rust size of every repeated element type of
    /// every message a server decodes (the types reachable from a method's input; replies
    /// are the client's, bounded by `REPLY_MESSAGE_MAX`). They are listed from the
    /// schema, so a new one fails here until its type is added below.
    #[test]
    fn element_bytes_covers_every_repeated_element() {
        use prost_types::field_descriptor_proto::{Label, Type};
        let set = prost_types::FileDescriptorSet::decode(allot_proto::FILE_DESCRIPTOR_SET).unwrap();
        let mut by_name: HashMap<String, &prost_types::DescriptorProto> = HashMap::new();
        fn index<'a>(
            prefix: &str,
            msgs: &'a [prost_types::DescriptorProto],
            out: &mut HashMap<String, &'a prost_types::DescriptorProto>,
        ) {
            for m in msgs {
                let name = format!("{prefix}.{}", m.name());
                out.insert(name.clone(), m);
                index(&name, &m.nested_type, out);
            }
        }
        for f in &set.file {
            index(&format!(".{}", f.package()), &f.message_type, &mut by_name);
        }
        let mut todo: Vec<String> = set
            .file
            .iter()
            .flat_map(|f| f.service.iter())
            .flat_map(|s| s.method.iter())
            .map(|m| m.input_type().to_string())
            .collect();
        let mut seen: std::collections::BTreeSet<String> = Default::default();
        let mut repeated: std::collections::BTreeSet<String> = Default::default();
        while let Some(t) = todo.pop() {
            if !seen.insert(t.clone()) {
                continue;
            }
            let m = by_name[&t];
            for f in &m.field {
                if f.r#type() == Type::Message {
                    todo.push(f.type_name().to_string());
                    if f.label() == Label::Repeated {
                        repeated.insert(f.type_name().rsplit('.').next().unwrap().to_string());
                    }
                }
            }
        }
        let sizes: std::collections::BTreeMap<&str, usize> = [
            ("Command", std::mem::size_of::<pb::Command>()),
            ("Member", std::mem::size_of::<allot_proto::Member>()),
            ("GpuPrice", std::mem::size_of::<pb::GpuPrice>()),
            ("Label", std::mem::size_of::<pb::Label>()),
            ("ProjectTiers", std::mem::size_of::<pb::ProjectTiers>()),
            ("TierConfig", std::mem::size_of::<pb::TierConfig>()),
            // A map entry: its key and value, and a control byte of the hash table.
            ("LabelsEntry", std::mem::size_of::<(String, String)>() + 1),
            // And the inputs themselves (the largest ones).
            ("ExecuteRequest", std::mem::size_of::<pb::ExecuteRequest>()),
            ("QueryRequest", std::mem::size_of::<pb::QueryRequest>()),
            (
                "RegisterNodeRequest",
                std::mem::size_of::<pb::RegisterNodeRequest>(),
            ),
            ("SetPlanRequest", std::mem::size_of::<pb::SetPlanRequest>()),
            (
                "SubmitJobRequest",
                std::mem::size_of::<pb::SubmitJobRequest>(),
            ),
            (
                "InitRequest",
                std::mem::size_of::<allot_proto::InitRequest>(),
            ),
        ]
        .into_iter()
        .collect();
        let unknown: Vec<&String> = repeated
            .iter()
            .filter(|n| !sizes.contains_key(n.as_str()))
            .collect();
        assert!(unknown.is_empty(), "add their sizes here: {unknown:?}");
        let schema = Schema::allot();
        for (name, size) in sizes {
            let bound = schema
                .size_of(name)
                .unwrap_or_else(|| panic!("{name} not found"));
            assert!(size <= bound, "{name}: {size} bytes, estimated {bound}");
        }
    }
}
