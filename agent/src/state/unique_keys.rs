//! A pass over the JSON text that finds a key repeated within one object. serde_json's value
//! tree keeps the last of them, so `"egress": [...], "egress": []` would read as an
//! unrestricted peer while a reviewer sees the rules: a state file with a repeated key is
//! rejected instead, naming where.

use std::{collections::HashSet, fmt};

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The first repeated key, as `(path of its object, key)`; `None` if there is none (or the
/// text is not JSON, which the caller reports).
pub(super) fn first_repeated(text: &str) -> Option<(String, String)> {
    let mut de = serde_json::Deserializer::from_str(text);
    // Not JSON: the caller reports that.
    (Check {
        path: String::new(),
    })
    .deserialize(&mut de)
    .unwrap_or_default()
}

/// Checks one JSON value at `path`; yields the first repeated key found in it.
struct Check {
    path: String,
}

impl<'de> DeserializeSeed<'de> for Check {
    type Value = Option<(String, String)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Check {
    type Value = Option<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        let mut found = None;
        while let Some(key) = map.next_key::<String>()? {
            if found.is_some() {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let path = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            found = map.next_value_seed(Check { path })?;
            if found.is_none() && !seen.insert(key.clone()) {
                found = Some((self.path.clone(), key));
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        let mut i = 0usize;
        loop {
            let next = if found.is_some() {
                seq.next_element::<IgnoredAny>()?.map(|_| None)
            } else {
                seq.next_element_seed(Check {
                    path: format!("{}[{i}]", self.path),
                })?
            };
            match next {
                Some(inner) => {
                    if found.is_none() {
                        found = inner;
                    }
                    i += 1;
                }
                None => return Ok(found),
            }
        }
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_keys_are_found_with_their_object() {
        assert_eq!(first_repeated(r#"{"a":1,"b":[1,{"c":2}]}"#), None);
        assert_eq!(
            first_repeated(r#"{"version":1,"version":1}"#),
            Some((String::new(), "version".into()))
        );
        assert_eq!(
            first_repeated(r#"{"peers":[{"n":1},{"egress":[{"cidr":"x"}],"egress":[]}]}"#),
            Some(("peers[1]".into(), "egress".into()))
        );
        // Equal keys in different objects are fine.
        assert_eq!(first_repeated(r#"[{"a":1},{"a":2}]"#), None);
    }
}
