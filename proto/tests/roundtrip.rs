//! Every message of the protocol survives encode -> decode -> encode with every field set,
//! including each member of every oneof. Messages are populated from the descriptor set, so a
//! field added to a .proto is covered without touching this test; a message added without
//! being listed below fails `every_message_is_listed`.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::collections::{BTreeSet, HashMap};

use prost::{Message, Name};
use prost_reflect::{
    DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MapKey, MessageDescriptor, Value,
};
use proto::v1;

fn pool() -> DescriptorPool {
    DescriptorPool::decode(proto::FILE_DESCRIPTOR_SET).expect("descriptor set decodes")
}

/// A non-default value of a field's kind; `salt` varies values between fields.
fn scalar(kind: &Kind, salt: u32, depth: u32) -> Value {
    match kind {
        Kind::Double => Value::F64(1.5 + f64::from(salt)),
        Kind::Float => Value::F32(0.25 + salt as f32),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(-(salt as i32) - 1),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(-i64::from(salt) - 1),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(salt + 1),
        // Above 2^32 so 64-bit fields are exercised as such (page offsets).
        Kind::Uint64 | Kind::Fixed64 => Value::U64((1u64 << 33) + u64::from(salt)),
        Kind::Bool => Value::Bool(true),
        Kind::String => Value::String(format!("s{salt}-é")),
        Kind::Bytes => Value::Bytes(vec![0, 255, salt as u8].into()),
        Kind::Enum(e) => Value::EnumNumber(e.values().map(|v| v.number()).max().unwrap_or(0)),
        Kind::Message(m) => Value::Message(populate(m, depth + 1, None)),
    }
}

fn field_value(field: &FieldDescriptor, salt: u32, depth: u32) -> Value {
    if field.is_map() {
        let Kind::Message(entry) = field.kind() else {
            unreachable!("map fields are entry messages")
        };
        let key = match scalar(&entry.map_entry_key_field().kind(), salt, depth) {
            Value::U32(v) => MapKey::U32(v),
            Value::String(s) => MapKey::String(s),
            Value::I32(v) => MapKey::I32(v),
            Value::U64(v) => MapKey::U64(v),
            other => panic!("unsupported map key {other:?}"),
        };
        let value = scalar(&entry.map_entry_value_field().kind(), salt, depth);
        Value::Map(HashMap::from([(key, value)]))
    } else if field.is_list() {
        Value::List(vec![
            scalar(&field.kind(), salt, depth),
            scalar(&field.kind(), salt + 7, depth),
        ])
    } else {
        scalar(&field.kind(), salt, depth)
    }
}

/// Sets every field; for each oneof, only the member `choice` selects (default: the first).
fn populate(desc: &MessageDescriptor, depth: u32, choice: Option<&str>) -> DynamicMessage {
    let mut msg = DynamicMessage::new(desc.clone());
    if depth > 4 {
        return msg;
    }
    for (i, field) in desc.fields().enumerate() {
        if let Some(oneof) = field.containing_oneof()
            && !oneof.is_synthetic()
        {
            let chosen = choice.map_or_else(
                || {
                    oneof
                        .fields()
                        .next()
                        .is_some_and(|f| f.name() == field.name())
                },
                |c| c == field.name(),
            );
            if !chosen {
                continue;
            }
        }
        msg.set_field(&field, field_value(&field, i as u32 + depth * 31, depth));
    }
    msg
}

/// Every variant of a message: one per member of its first real oneof, or just one.
fn variants(desc: &MessageDescriptor) -> Vec<DynamicMessage> {
    match desc.oneofs().find(|o| !o.is_synthetic()) {
        Some(oneof) => oneof
            .fields()
            .map(|f| populate(desc, 0, Some(f.name())))
            .collect(),
        None => vec![populate(desc, 0, None)],
    }
}

fn roundtrip<T: Message + Name + Default + PartialEq + Clone + std::fmt::Debug>(
    pool: &DescriptorPool,
) -> String {
    let name = T::full_name();
    let desc = pool
        .get_message_by_name(&name)
        .unwrap_or_else(|| panic!("{name} missing from descriptor set"));
    for original in variants(&desc) {
        let wire = original.encode_to_vec();
        let typed = T::decode(wire.as_slice()).unwrap_or_else(|e| panic!("{name}: {e}"));
        if desc.fields().len() > 0 {
            assert_ne!(
                typed,
                T::default(),
                "{name}: populated message decoded as default"
            );
        }
        let rewire = typed.encode_to_vec();
        let back = DynamicMessage::decode(desc.clone(), rewire.as_slice()).unwrap();
        assert_eq!(back, original, "{name}: fields lost in round trip");
        // And the typed value is stable through a second pass.
        assert_eq!(T::decode(rewire.as_slice()).unwrap(), typed, "{name}");
        for field in desc.fields() {
            if field.containing_oneof().is_none_or(|o| o.is_synthetic()) {
                assert!(
                    original.has_field(&field),
                    "{name}.{} not populated",
                    field.name()
                );
            }
        }
    }
    name
}

macro_rules! all_messages {
    ($($ty:ident),* $(,)?) => {
        fn check_all(pool: &DescriptorPool) -> BTreeSet<String> {
            let mut names = BTreeSet::new();
            $( names.insert(roundtrip::<v1::$ty>(pool)); )*
            names
        }
    };
}

all_messages!(
    // common.proto
    RequestId,
    SamplingParams,
    OutputConstraint,
    StopConditions,
    TokenLogprob,
    GeneratedToken,
    Usage,
    Timings,
    ErrorInfo,
    Ack,
    // layout.proto
    Region,
    StateLayout,
    // transfer.proto
    MemoryRegion,
    UcxTarget,
    TcpTarget,
    NcclTarget,
    PageRef,
    TransferDescriptor,
    PageChecksum,
    PageWrite,
    PageWriteSummary,
    TransferHello,
    TransferHelloReply,
    NcclConnectRequest,
    NcclPiece,
    NcclExpectRequest,
    NcclExpectReply,
    // prefill.proto
    PrefillRequest,
    PrefillResponse,
    CancelRequest,
    // decode.proto
    ReserveRequest,
    ReserveResponse,
    CommitRequest,
    GenerateRequest,
    TokenBatch,
    // worker.proto
    Load,
    LoadProgress,
    GroupLayout,
    Compute,
    WorkerInfo,
    InfoRequest,
    DrainRequest,
    RegisterRequest,
    RegisterResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    DeregisterRequest,
);

#[test]
fn every_message_round_trips() {
    check_all(&pool());
}

#[test]
fn every_message_is_listed() {
    let pool = pool();
    let declared: BTreeSet<String> = pool
        .all_messages()
        .filter(|m| !m.is_map_entry())
        .map(|m| m.full_name().to_owned())
        .collect();
    assert_eq!(check_all(&pool), declared);
}

#[test]
fn every_service_is_named() {
    let services: BTreeSet<String> = pool()
        .services()
        .map(|s| s.full_name().to_owned())
        .collect();
    let named: BTreeSet<String> = [
        proto::service_names::PREFILL,
        proto::service_names::DECODE,
        proto::service_names::STATE_TRANSFER,
        proto::service_names::WORKER,
        proto::service_names::REGISTRY,
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(services, named);
}

#[test]
fn every_element_is_documented() {
    // Every message, field, enum, value and service method carries a leading comment.
    let fds = prost_types::FileDescriptorSet::decode(proto::FILE_DESCRIPTOR_SET).unwrap();
    let mut undocumented = Vec::new();
    for file in &fds.file {
        let info = file
            .source_code_info
            .as_ref()
            .expect("protox keeps source info");
        let documented: BTreeSet<Vec<i32>> = info
            .location
            .iter()
            .filter(|l| {
                l.leading_comments
                    .as_deref()
                    .is_some_and(|c| !c.trim().is_empty())
            })
            .map(|l| l.path.clone())
            .collect();
        let mut need = |path: Vec<i32>, what: String| {
            if !documented.contains(&path) {
                undocumented.push(format!("{}: {what}", file.name()));
            }
        };
        // Paths follow descriptor.proto field numbers: 4 message_type, 2 field, 8 oneof_decl,
        // 5 enum_type, 2 value, 6 service, 2 method.
        for (m, msg) in file.message_type.iter().enumerate() {
            need(vec![4, m as i32], msg.name().to_owned());
            for (f, field) in msg.field.iter().enumerate() {
                need(
                    vec![4, m as i32, 2, f as i32],
                    format!("{}.{}", msg.name(), field.name()),
                );
            }
        }
        for (e, en) in file.enum_type.iter().enumerate() {
            need(vec![5, e as i32], en.name().to_owned());
            for (v, value) in en.value.iter().enumerate() {
                need(vec![5, e as i32, 2, v as i32], value.name().to_owned());
            }
        }
        for (s, svc) in file.service.iter().enumerate() {
            need(vec![6, s as i32], svc.name().to_owned());
            for (m, method) in svc.method.iter().enumerate() {
                need(
                    vec![6, s as i32, 2, m as i32],
                    format!("{}.{}", svc.name(), method.name()),
                );
            }
        }
    }
    assert!(undocumented.is_empty(), "undocumented: {undocumented:#?}");
}

#[test]
fn layout_equality_survives_the_wire() {
    let desc = pool()
        .get_message_by_name("pdserve.v1.StateLayout")
        .unwrap();
    let dynamic = populate(&desc, 0, None);
    let a = v1::StateLayout::decode(dynamic.encode_to_vec().as_slice()).unwrap();
    let b = v1::StateLayout::decode(a.encode_to_vec().as_slice()).unwrap();
    assert_eq!(a, b);
    assert!(proto::layout::check_compatible(&a, &b).is_ok());
    let mut c = b.clone();
    c.regions[1].offset_bytes += 64;
    assert_ne!(a, c);
    let err = proto::layout::check_compatible(&a, &c).unwrap_err();
    assert_eq!(err.differences.len(), 1, "{err}");
    assert!(err.differences[0].starts_with("regions[1]"), "{err}");
}
