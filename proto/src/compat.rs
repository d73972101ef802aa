//! Wire compatibility of the `weft.v1` API with its last release.
//!
//! Sites, agents and `weftctl` of different releases talk to each other
//! (a controller is upgraded before its agents, one site before its
//! peers), so a change to `proto/` must keep every message readable by the
//! other side. [`check`] compares the API as it is ([`current`]) with the
//! last release's, kept in the repository as a baseline
//! (`proto/baseline/`, compiled by the build into [`baseline`]), and names
//! each change that breaks the wire:
//!
//! - a field's number given to another field (a different name), or its
//!   type or cardinality changed (repeated or not, a message of another
//!   type);
//! - a field removed without its number reserved (a later field could take
//!   it, and old senders would fill it with something else);
//! - a field moved to another number (old peers send the old one);
//! - an enum value renumbered, or removed without its number reserved;
//! - a message, enum, service or method removed, or a method's request or
//!   response changed.
//!
//! Adding messages, fields, enum values and methods is compatible: an
//! older reader skips what it does not know. What no check sees is a
//! field whose meaning changes under the same number and type: that needs
//! a new field, or a feature the receiver says it has (as
//! `PUNCH_BESIDE_FEATURE`).

use std::collections::BTreeMap;

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorSet, ServiceDescriptorProto,
};

/// The release the baseline is of (`proto/baseline/VERSION`).
pub const BASELINE_VERSION: &str = include_str!("../baseline/VERSION");

/// The API as this source tree defines it.
pub fn current() -> FileDescriptorSet {
    FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).expect("the build's own descriptor set")
}

/// The API of the last release ([`BASELINE_VERSION`]).
pub fn baseline() -> FileDescriptorSet {
    FileDescriptorSet::decode(BASELINE_DESCRIPTOR_SET).expect("the build's baseline descriptor set")
}

const BASELINE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/baseline_descriptor.bin"));

/// Every message, enum and service of `set`, by full name (`weft.v1.Foo`,
/// `weft.v1.Foo.Bar` for a nested one).
#[derive(Default)]
struct Index<'a> {
    messages: BTreeMap<String, &'a DescriptorProto>,
    enums: BTreeMap<String, &'a EnumDescriptorProto>,
    services: BTreeMap<String, &'a ServiceDescriptorProto>,
}

fn index(set: &FileDescriptorSet) -> Index<'_> {
    fn message<'a>(ix: &mut Index<'a>, scope: &str, m: &'a DescriptorProto) {
        let name = format!("{scope}.{}", m.name());
        for n in &m.nested_type {
            message(ix, &name, n);
        }
        for e in &m.enum_type {
            ix.enums.insert(format!("{name}.{}", e.name()), e);
        }
        ix.messages.insert(name, m);
    }
    let mut ix = Index::default();
    for f in &set.file {
        let scope = f.package();
        for m in &f.message_type {
            message(&mut ix, scope, m);
        }
        for e in &f.enum_type {
            ix.enums.insert(format!("{scope}.{}", e.name()), e);
        }
        for s in &f.service {
            ix.services.insert(format!("{scope}.{}", s.name()), s);
        }
    }
    ix
}

/// A field's type as the wire sees it: scalar type, or the message or enum
/// it names, and whether it repeats.
fn shape(f: &FieldDescriptorProto) -> String {
    let repeated = f.label() == Label::Repeated;
    let ty = match f.r#type() {
        Type::Message | Type::Enum | Type::Group => f.type_name().trim_start_matches('.').to_string(),
        t => t.as_str_name().trim_start_matches("TYPE_").to_lowercase(),
    };
    if repeated { format!("repeated {ty}") } else { ty }
}

fn reserved_number(m: &DescriptorProto, n: i32) -> bool {
    // (DescriptorProto's reserved ranges end exclusive)
    m.reserved_range.iter().any(|r| r.start() <= n && n < r.end())
}

fn reserved_value(e: &EnumDescriptorProto, n: i32) -> bool {
    // (EnumDescriptorProto's reserved ranges end inclusive)
    e.reserved_range.iter().any(|r| r.start() <= n && n <= r.end())
}

/// What in `new` breaks the wire for readers and writers of `old`, one
/// sentence each (empty: compatible).
pub fn check(old: &FileDescriptorSet, new: &FileDescriptorSet) -> Vec<String> {
    let (old, new) = (index(old), index(new));
    let mut out = Vec::new();
    for (name, m) in &old.messages {
        let Some(n) = new.messages.get(name) else {
            out.push(format!("message {name} was removed"));
            continue;
        };
        for f in &m.field {
            let at = format!("{name}.{} = {}", f.name(), f.number());
            match n.field.iter().find(|x| x.number() == f.number()) {
                Some(x) if x.name() != f.name() => out.push(format!(
                    "{at}: the number now belongs to field {:?}; give the new field a new number and reserve this one",
                    x.name()
                )),
                Some(x) if shape(x) != shape(f) => out.push(format!(
                    "{at}: its type changed from {} to {}; add a field with a new number instead",
                    shape(f),
                    shape(x)
                )),
                Some(_) => {}
                None => {
                    if let Some(x) = n.field.iter().find(|x| x.name() == f.name()) {
                        out.push(format!(
                            "{at}: moved to number {}; a field keeps its number for good",
                            x.number()
                        ));
                    } else if !reserved_number(n, f.number()) {
                        out.push(format!(
                            "{at}: removed without its number reserved; add `reserved {};`",
                            f.number()
                        ));
                    }
                }
            }
        }
        for x in &n.field {
            let was = m.field.iter().any(|f| f.number() == x.number());
            if !was && reserved_number(m, x.number()) {
                out.push(format!(
                    "{name}.{} = {}: the number was reserved in {BASELINE_VERSION}; take another",
                    x.name(),
                    x.number()
                ));
            }
        }
    }
    for (name, e) in &old.enums {
        let Some(n) = new.enums.get(name) else {
            out.push(format!("enum {name} was removed"));
            continue;
        };
        for v in &e.value {
            let at = format!("{name}.{} = {}", v.name(), v.number());
            match (
                n.value.iter().find(|x| x.name() == v.name()),
                n.value.iter().find(|x| x.number() == v.number()),
            ) {
                (Some(x), _) if x.number() != v.number() => out.push(format!(
                    "{at}: renumbered to {}; a value keeps its number for good",
                    x.number()
                )),
                (Some(_), _) => {}
                (None, Some(x)) => out.push(format!(
                    "{at}: the number now belongs to {:?}; give the new value a new number",
                    x.name()
                )),
                (None, None) if !reserved_value(n, v.number()) => out.push(format!(
                    "{at}: removed without its number reserved; add `reserved {};`",
                    v.number()
                )),
                (None, None) => {}
            }
        }
    }
    for (name, s) in &old.services {
        let Some(n) = new.services.get(name) else {
            out.push(format!("service {name} was removed"));
            continue;
        };
        for m in &s.method {
            let at = format!("{name}.{}", m.name());
            match n.method.iter().find(|x| x.name() == m.name()) {
                None => out.push(format!("{at} was removed")),
                Some(x) if (x.input_type(), x.output_type()) != (m.input_type(), m.output_type()) => out.push(format!(
                    "{at}: its request or response changed ({} -> {} now {} -> {})",
                    m.input_type(),
                    m.output_type(),
                    x.input_type(),
                    x.output_type()
                )),
                Some(x)
                    if (x.client_streaming(), x.server_streaming()) != (m.client_streaming(), m.server_streaming()) =>
                {
                    out.push(format!("{at}: its streaming changed"))
                }
                Some(_) => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_stays_wire_compatible_with_the_last_release() {
        let broken = check(&baseline(), &current());
        assert!(
            broken.is_empty(),
            "proto/ breaks the wire for {BASELINE_VERSION}:\n{}",
            broken.join("\n")
        );
    }

    /// The current API with `change` made to message `message`'s fields.
    fn changed(message: &str, change: impl FnOnce(&mut Vec<FieldDescriptorProto>)) -> FileDescriptorSet {
        let mut set = current();
        let m = set
            .file
            .iter_mut()
            .flat_map(|f| f.message_type.iter_mut())
            .find(|m| m.name() == message)
            .expect("the message");
        change(&mut m.field);
        set
    }

    #[test]
    fn a_reused_number_a_changed_type_a_moved_or_dropped_field_are_each_named() {
        let base = baseline();
        // A new field given an old field's number (the old one removed).
        let reused = changed("TransitRoute", |f| {
            let old = f.iter().position(|x| x.name() == "external_cidr").unwrap();
            f[old].name = Some("next_hop".into());
        });
        let e = check(&base, &reused).join("\n");
        assert!(
            e.contains("weft.v1.TransitRoute.external_cidr = 3: the number now belongs to field \"next_hop\""),
            "{e}"
        );
        // A type changed.
        let retyped = changed("TransitRoute", |f| {
            let x = f.iter_mut().find(|x| x.name() == "external_cidr").unwrap();
            x.set_type(Type::Bytes);
        });
        let e = check(&base, &retyped).join("\n");
        assert!(e.contains("its type changed from string to bytes"), "{e}");
        // Repeated made single.
        let single = changed("TransitRoute", |f| {
            let x = f.iter_mut().find(|x| x.name() == "workload_cidrs").unwrap();
            x.set_label(Label::Optional);
        });
        assert!(
            check(&base, &single)
                .join("\n")
                .contains("from repeated string to string")
        );
        // Moved to another number.
        let moved = changed("TransitRoute", |f| {
            let x = f.iter_mut().find(|x| x.name() == "site").unwrap();
            x.number = Some(99);
        });
        assert!(
            check(&base, &moved)
                .join("\n")
                .contains("TransitRoute.site = 1: moved to number 99")
        );
        // Dropped without reserving its number; then reserved: compatible.
        let mut dropped = changed("TransitRoute", |f| f.retain(|x| x.name() != "external_cidr"));
        let e = check(&base, &dropped).join("\n");
        assert!(
            e.contains("removed without its number reserved; add `reserved 3;`"),
            "{e}"
        );
        for f in &mut dropped.file {
            for m in f.message_type.iter_mut().filter(|m| m.name() == "TransitRoute") {
                m.reserved_range.push(prost_types::descriptor_proto::ReservedRange {
                    start: Some(3),
                    end: Some(4),
                });
            }
        }
        assert!(check(&base, &dropped).is_empty(), "{:?}", check(&base, &dropped));
        // A new field is compatible.
        let added = changed("TransitRoute", |f| {
            let mut x = f[0].clone();
            (x.name, x.number) = (Some("added".into()), Some(100));
            f.push(x);
        });
        assert!(check(&base, &added).is_empty());
    }

    #[test]
    fn a_renumbered_enum_value_and_a_removed_method_are_named() {
        let base = baseline();
        let mut set = current();
        let e = set
            .file
            .iter_mut()
            .flat_map(|f| f.enum_type.iter_mut())
            .find(|e| e.name() == "CidrKind")
            .expect("CidrKind");
        let last = e.value.len() - 1;
        e.value[last].number = Some(77);
        let s = set
            .file
            .iter_mut()
            .flat_map(|f| f.service.iter_mut())
            .next()
            .expect("a service");
        let gone = s.method.remove(0).name().to_string();
        let out = check(&base, &set).join("\n");
        assert!(out.contains("renumbered to 77"), "{out}");
        assert!(out.contains(&format!(".{gone} was removed")), "{out}");
    }
}
